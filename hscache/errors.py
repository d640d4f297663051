"""The exceptions hscache raises on bad input, each a subclass of a Python built-in.

Messages are one line: what is wrong, the offending value, what was expected, the fix.
The CLI prints ``error: <message>`` and exits 2 for any of these.
"""

from __future__ import annotations

__all__ = [
    "HscacheError",
    "InputError",
    "PromptFileError",
    "LayerSpecError",
    "ModelNotFoundError",
    "BackendUnavailableError",
    "CacheNotFoundError",
    "CacheFormatError",
    "ResumeMismatchError",
    "StoreWriteError",
    "CacheLockedError",
    "CacheMismatchError",
]


class HscacheError(Exception):
    """Base class of every error hscache raises on purpose."""


class InputError(HscacheError, ValueError):
    """A user-supplied value is invalid."""


class PromptFileError(InputError):
    """The prompts file is missing, empty or has a malformed line."""


class LayerSpecError(InputError):
    """A --layers value is malformed, out of range or duplicated."""


class ModelNotFoundError(HscacheError, FileNotFoundError):
    """--model names neither a built-in target nor a local Hugging Face directory."""


class BackendUnavailableError(HscacheError, RuntimeError):
    """The requested linear-attention backend cannot run on this machine."""


class CacheNotFoundError(HscacheError, FileNotFoundError):
    """A path given as a cache holds no hscache store."""


class CacheFormatError(HscacheError, ValueError):
    """A cache exists but its manifest, index or arrays are inconsistent or of an unknown version."""


class ResumeMismatchError(HscacheError, ValueError):
    """An extraction was resumed with settings that differ from the existing cache's."""


class StoreWriteError(HscacheError, OSError):
    """Writing to the store failed (disk full, permissions); committed sequences are intact."""


class CacheMismatchError(HscacheError, ValueError):
    """Two caches cannot be compared: different sequences, token ids, layers or hidden size."""


class CacheLockedError(HscacheError, RuntimeError):
    """Another live process is writing the cache (one writer per cache: hscache/store/lock.py)."""
