"""Remote storage: listing, fingerprints, and requests, one module per job.

* :mod:`~fastload.source.core`: :class:`Source`, one location's identity and the dispatch of its requests
  (with retries, backoff and error translation);
* :mod:`~fastload.source.items`: :class:`RemoteItem` and the glob that filters a listing;
* :mod:`~fastload.source.listing`: crawling an HTTP server's folder pages;
* :mod:`~fastload.source.aio`: HTTP on fsspec's aiohttp session;
* :mod:`~fastload.source.s3`: S3 GETs signed on libcurl's engine (:mod:`fastload.transport.curl`), one route per bucket;
* :mod:`~fastload.source.s3_resolve`: what botocore resolves for an S3 configuration (endpoint, region,
  signing, CA), and each bucket's learned region.

What a request's failure means is :mod:`fastload.transport.failures`; how an HTTP answer
reads is :mod:`fastload.transport.answers`; requests in flight are :mod:`fastload.transport.hostlimit`.

Layer: above fastload.stats (which it does not need) and fastload.transport; imports only
transport and the ground (config, errors); imported by fastload.fetch, fastload.read, the faces,
diagnose and the CLI. fastload.cache sits above it in the layer list without importing it.
"""

from fastload.source.core import Source
from fastload.source.items import RemoteItem, glob_to_regex, matching, nothing_matched

__all__ = ["RemoteItem", "Source", "glob_to_regex", "matching", "nothing_matched"]
