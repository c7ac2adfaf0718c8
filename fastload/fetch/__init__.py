"""The fetch layer: remote to memory and the cache, the only read-path caller of a Source.

A cold training read, layer by layer, with each one's concurrency beside it
(num_workers=0 and a dataset with ``read_batch``; with worker processes each worker
runs the read side, from ``read_batch`` down, on its own)::

    sampler                          consumer thread: index order, sharding, resume (loader/sampler.py)
      |  index batches
    Announcer (ahead.py)             consumer thread: draws AHEAD_ITEMS samples ahead per
      |        \\                     reading process, announces each batch once
      |         `-> Fetcher.ahead    no thread: first blocks requested on the Source's road,
      |                              at most 2 x AHEAD_ITEMS in flight per Fetcher
    ReadAhead (loader/readahead.py)  read_threads threads (CPUs, 2 to 8), read_ahead batches
      |  read_batch(chunk)           beyond the one returned
    Reader.read_into (read/reader.py)  in that read thread
      |-- hit:  Cache.read_into      in that read thread (C, off the GIL)
      `-- miss: Fetcher.fetch        in that read thread: one table of fetches in flight
            |                        (each block fetched once), one put_many per call
          Source (source/)           requests held to HostLimit slots (transport/hostlimit.py):
            |                        <= Settings.max_requests per host, adaptive under it
          road: libcurl's engine     its C thread + one pump thread per process (transport/curl.py);
                or fsspec's loop     or fsspec's event loop thread (source/aio.py)
    decode + collate                 read thread (CPU decode) / DALI's threads; collate in
      |                              the consumer thread
    DevicePrefetcher (device/prefetch.py) pinned host slots, ``depth`` device copies ahead on
                                     a CUDA stream (the only "prefetch")

Modules:

* :mod:`~fastload.fetch.fetcher`: :class:`Fetcher`: complete sizeless items, fetch
  blocks (a whole object streamed where a server ignores Range), store and return them;
  staging's calls ``OVERLAP`` at once (``fetch_in_turn``: one stores while the next fetches);
* :mod:`~fastload.fetch.base`: the Fetcher's parts: the per-process table of fetches in
  flight and the node-wide markers (fastload/cache/flights.py): mark, wait, land, store;
* :mod:`~fastload.fetch.ahead`: :data:`AHEAD_ITEMS` (the one fetch-ahead depth), the
  announcement of index batches, here or to worker processes, and ``FetcherAhead``
  (first blocks fetched ahead, taken by reads, stored early while another process waits);
* :mod:`~fastload.fetch.identity`: block identity (cache keys, block spans, pins,
  manifests), shared with the Reader.

The Fetcher is made from a Reader's parts (Sources, Cache, Identity) and never
calls back into the Reader: layers point one way (reader -> fetch -> identity, source, cache).

Layer: above fastload.cache, fastload.source, fastload.stats and fastload.transport; holds
block identity (:mod:`~fastload.fetch.identity`, which the Reader reads too); imported by the
read layer (the Reader, on a miss) and by the faces (fastload.dataset announces batches).
"""

from fastload.fetch.ahead import (
           AHEAD_ITEMS,
           AheadSampler,
           Announced,
           Announcer,
           announce,
           depth_for,
)
from fastload.fetch.fetcher import AHEAD_FLIGHTS, COMPLETING, Fetcher

__all__ = ["AHEAD_FLIGHTS", "AHEAD_ITEMS", "COMPLETING", "AheadSampler", "Announced", "Announcer", "Fetcher",
           "announce", "depth_for"]
