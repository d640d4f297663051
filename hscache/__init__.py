"""hscache: extract a target model's hidden states once, into a self-describing cache.

>>> import hscache
>>> hscache.extract(hscache.ExtractConfig(out="cache/", layers="1,3,5"))   # doctest: +SKIP
>>> cache = hscache.open_cache("cache/")                                     # doctest: +SKIP
>>> cache.hidden_states(0).shape                                             # doctest: +SKIP
"""

from hscache.capture.extract import ExtractConfig, ExtractResult, Progress, extract
from hscache.diff.compare import diff_caches
from hscache.diff.report import DiffReport
from hscache.errors import *  # noqa: F403  (the exception hierarchy is public API)
from hscache.errors import __all__ as _error_names
from hscache.store.open import open_cache
from hscache.store.reader import Cache
from hscache.store.view import CacheView

__version__ = "0.1.0"
__all__ = [
    "Cache",
    "CacheView",
    "DiffReport",
    "ExtractConfig",
    "ExtractResult",
    "Progress",
    "diff_caches",
    "extract",
    "open_cache",
    *_error_names,
]
