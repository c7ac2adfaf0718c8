"""The transport layer: requests on the wire, below every Source.

* :mod:`~fastload.transport.curl`: the binding of libcurl's engine (``fastload._curl``,
  native/_curl.c) and its routes;
* :mod:`~fastload.transport.hostlimit`: requests in flight per host, the one home of
  ``max_requests`` and its adaptive controller;
* :mod:`~fastload.transport.answers`: how an HTTP answer reads (first-block info, folder pages);
* :mod:`~fastload.transport.failures`: what a failure means (transient, congestion, secrets);
* :mod:`~fastload.transport.loop`: running coroutines on fsspec's event loop;
* :mod:`~fastload.transport.tls`: the CA bundle both roads trust (REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE).

Layer: imports only the ground (fastload.config, fastload.errors); imported by
fastload.stats (the host limits it shows), fastload.source and the fetch layer.
"""
