"""hscache: extract a target model's hidden states once, into a self-describing cache.

>>> import hscache
>>> hscache.extract(hscache.ExtractConfig(out="cache/", layers="1,3,5"))   # doctest: +SKIP
>>> cache = hscache.open_cache("cache/")                                     # doctest: +SKIP
>>> cache.hidden_states(0).shape                                             # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hscache.errors import *  # noqa: F403  (the exception hierarchy is public API)
from hscache.errors import __all__ as _error_names

if TYPE_CHECKING:
    from hscache.capture.extract import ExtractConfig, ExtractResult, Progress, extract
    from hscache.diff.compare import diff_caches
    from hscache.diff.report import DiffReport
    from hscache.store.integrity import cache_digest
    from hscache.store.open import open_cache
    from hscache.store.reader import Cache
    from hscache.store.sampling import SamplingSetting, sampling_setting
    from hscache.store.view import CacheView

# The public API is imported on first use: `hscache --help` (and every command's early errors)
# must not pay for torch and transformers, which these modules import.
_LAZY = {
    "Cache": "hscache.store.reader",
    "open_cache": "hscache.store.open",
    "cache_digest": "hscache.store.integrity",
    "CacheView": "hscache.store.view",
    "SamplingSetting": "hscache.store.sampling",
    "sampling_setting": "hscache.store.sampling",
    "DiffReport": "hscache.diff.report",
    "diff_caches": "hscache.diff.compare",
    "ExtractConfig": "hscache.capture.extract",
    "ExtractResult": "hscache.capture.extract",
    "Progress": "hscache.capture.extract",
    "extract": "hscache.capture.extract",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hscache' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__version__ = "0.1.0"
__all__ = [
    "Cache",
    "CacheView",
    "DiffReport",
    "ExtractConfig",
    "ExtractResult",
    "Progress",
    "SamplingSetting",
    "cache_digest",
    "diff_caches",
    "extract",
    "open_cache",
    "sampling_setting",
    *_error_names,
]
