"""The on-disk store: layout, durable writes, and the reader behind ``hscache.open_cache``."""
