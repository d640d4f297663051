"""Every byte of a cache, written and read: layout, durable writes, index, target files, provenance, and the readers (``open_cache`` -> a ``CacheView``)."""
