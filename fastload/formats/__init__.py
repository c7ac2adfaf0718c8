"""Datasets over shard formats other libraries write (MosaicML Streaming's MDS, LitData), read in place.

Each reads its format's index and shards itself (public layouts; the writers' libraries are
not imported on the read path), through the cache, as fastload.dataset's datasets do.
"""
