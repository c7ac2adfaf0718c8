"""The device layer: where a batch's bytes live between the read and the training step.

* :mod:`~fastload.device.prefetch`: :class:`~fastload.device.prefetch.DevicePrefetcher`,
  the pinned, double-buffered host-to-device copy (the only "prefetch"), and its slots;
* :mod:`~fastload.device.worker_pack`: a worker's batch payload moved to the parent through
  reused shared memory (and the buffer a FileDataset reads a batch straight into);
* :mod:`~fastload.device.batch_tree`: walking a batch's nested tensors (collect, rebuild, nbytes);
* :mod:`~fastload.device.torch_compat`: the newest torch accelerator API, or older torch's.

Layer: imports only fastload.stats, fastload.cache.gather (split: a batch's samples copied out
of a buffer) and the ground (config, errors); beside fastload.read;
imported by the faces (fastload.dataset), fastload.loader and fastload.pipelines.
"""
