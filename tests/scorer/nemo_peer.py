"""NeMo Automodel 0.7 (the peer oracle of DFlash2 and DSpark) imported from ``.peers/``.

nemo-automodel 0.7.0 is installed ``--no-deps --target .peers`` (test-only; .ci/run installs it beside the
EAGLE-3 peers): its draft models run on CPU in plain torch. Its package ``__init__`` files import the
training data stack (``datasets``), which the draft models never call; `nemo_module` stubs those two
imports when ``datasets`` is absent, and skips the test when nemo-automodel is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / ".peers"
_DATASETS = "nemo_automodel.components.datasets.llm"


def nemo_module(name: str, bare: str | None = None) -> types.ModuleType:
    """NeMo's module ``name`` from ``.peers/`` (sys.path and sys.modules restored afterwards, except the
    NeMo modules themselves); skip when nemo-automodel is not installed. ``bare``: a NeMo package whose
    ``__init__`` is skipped (the EAGLE package's imports every draft class, seconds of CPU)."""
    if not (PEERS / "nemo_automodel").is_dir():
        pytest.skip("peer oracle not installed: pip install --no-deps --target .peers nemo-automodel==0.7.0")
    saved_path, stubbed = list(sys.path), []
    sys.path.insert(0, str(PEERS))
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")
        stub.Dataset = type("Dataset", (), {})
        stub.DatasetDict = type("DatasetDict", (), {})
        sys.modules["datasets"] = stub
        stubbed.append("datasets")
    try:
        if _DATASETS not in sys.modules:  # its __init__ imports dataset builders; the mask helper needs none
            package = types.ModuleType(_DATASETS)
            package.__path__ = [str(PEERS / "nemo_automodel" / "components" / "datasets" / "llm")]
            sys.modules[_DATASETS] = package
        for stubbed_init in (bare,) if bare and bare not in sys.modules else ():
            importlib.import_module(stubbed_init.rsplit(".", 1)[0])  # its parents, as they are
            package = types.ModuleType(stubbed_init)
            package.__path__ = [str(PEERS.joinpath(*stubbed_init.split(".")))]
            sys.modules[stubbed_init] = package
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved_path
        for stub_name in stubbed:  # nothing else may see a fake `datasets` (transformers probes it)
            del sys.modules[stub_name]
