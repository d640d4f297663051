"""A dask client for scale-out runs (sharded extraction, distributed scoring): one place to make it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hscache.errors import InputError

__all__ = ["cluster_client"]


@contextlib.contextmanager
def cluster_client(scheduler: str | None = None, workers: int | None = None) -> Iterator[Any]:
    """A ``distributed.Client`` on ``scheduler`` (an address) or on a LocalCluster of ``workers``
    single-threaded worker processes started for the block.

    Raises:
        InputError: both or neither given.
    """
    from distributed import Client, LocalCluster

    if (scheduler is None) == (workers is None):
        raise InputError("give exactly one of --scheduler ADDRESS or --workers N")
    if scheduler is not None:
        with Client(scheduler) as client:
            yield client
        return
    with (
        LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client
