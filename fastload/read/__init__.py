"""The read layer: what a process reads, cache to a buffer, through the fetch layer on a miss.

* :mod:`~fastload.read.reader`: :class:`~fastload.read.reader.Reader`, a dataset's one door
  to its bytes: listings, checked reads of the cache, the fetch stage on a miss;
* :mod:`~fastload.read.ahead`: the blocks of announced samples of shard datasets, fetched ahead
  (:data:`~fastload.read.ahead.AHEAD_BYTES` at most, per dataset and process);
* :mod:`~fastload.read.partition`: node parts, which items each node of a cluster reads
  (``partition="node"``; the sampler and ``fastload cache --nodes`` both ask it);
* :mod:`~fastload.read.npy`: a remote .npy file's header, parsed without unpickling;
* :mod:`~fastload.read.heap`: glibc told to keep freed memory for the next objects read (the
  DataLoader sets it once per process).

Layer: above fastload.fetch (the Reader calls it on a miss), fastload.cache, fastload.source
and fastload.stats; beside fastload.device (neither imports the other); imported by the faces
(fastload.dataset, fs, stage), the loader's sampler, the pipelines, diagnose and the CLI.
"""
