"""Stage one, capture: load the target, pick backend and layers, run it, hand rows to the store (target -> capture -> extract)."""
