"""Compare two caches: per-layer hidden-state drift and next-token agreement, as JSON-able reports."""
