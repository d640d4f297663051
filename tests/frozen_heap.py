"""Imported last by a forkserver's preload (tests/conftest.py ``dask_client``): freezes the heap the
preloaded imports made (gc.freeze), so the processes it forks never walk those objects in a collection
(nor copy the pages they sit on by writing their reference counts)."""

import gc

gc.freeze()
