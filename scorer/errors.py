"""Exceptions raised by the scorer package, built on Python's own so callers can catch either."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompatibleCacheError",
    "ScorerError",
    "UntrustedCheckpointError",
]


class ScorerError(Exception):
    """Base of every error the scorer raises on purpose."""


class CheckpointError(ScorerError, ValueError):
    """A checkpoint is unreadable or is not a DFlash drafter (names the offending keys)."""


class CheckpointNotFoundError(ScorerError, FileNotFoundError):
    """The checkpoint path does not exist or holds no weights file."""


class UntrustedCheckpointError(CheckpointError):
    """A pickle checkpoint needs full unpickling (arbitrary code) and the caller did not trust it."""


class IncompatibleCacheError(ScorerError, ValueError):
    """A hidden-state cache does not match the drafter (layers, hidden size, vocabulary...)."""
