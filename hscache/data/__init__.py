"""Training on a cache: torch datasets (per sequence, packed windows) and an xarray view.

The package folder also holds the built-in prompt files (``default_prompts.jsonl``).
"""

from hscache.data.dataset import PackedWindows, SequenceDataset
from hscache.data.views import open_xarray

__all__ = ["PackedWindows", "SequenceDataset", "open_xarray"]
