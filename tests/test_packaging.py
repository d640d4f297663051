"""Issue 20.15: the JSON Schemas ship inside ``hscache`` (no top-level ``schemas`` in site-packages),
and a plain, non-editable install works from another directory, bundled data included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_hscache_schemas_is_the_repository_schemas_folder():
    from hscache import schemas

    repo = sorted(p.name for p in (ROOT / "schemas").glob("*.schema.json"))
    assert repo and (ROOT / "hscache" / "schemas").resolve() == (ROOT / "schemas").resolve()
    for name in repo:
        bundled = Path(schemas.__file__).parent / name
        assert bundled.read_bytes() == (ROOT / "schemas" / name).read_bytes(), name
        assert schemas.load_schema(name.removesuffix(".schema.json"))["type"] == "object"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "schemas/*.json" in project["package-data"]["hscache"]
    assert not any(p.startswith("schemas") for p in project["packages"]["find"]["include"])


@pytest.mark.slow
def test_a_built_wheel_carries_the_schemas_and_runs_from_another_directory(tmp_path):
    """Built offline from a copy of the sources by the build backend pyproject.toml declares (its PEP 517
    ``build_wheel`` hook in a fresh interpreter, as ``pip wheel --no-build-isolation`` calls it, without
    pip's own ~1 CPU-s around it; no editable install), then imported from the unpacked wheel in a
    directory that is not the repository."""
    source = tmp_path / "src"
    for name in ("hscache", "scorer", "pipelines", "schemas"):
        shutil.copytree(
            ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    backend = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["build-backend"]
    hook = f"import importlib, sys; print(importlib.import_module({backend!r}).build_wheel(sys.argv[1]))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the backend reads ./, not the repo
    done = subprocess.run(
        [sys.executable, "-c", hook, str(wheels)],
        capture_output=True, text=True, cwd=source, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = wheels.glob("hscache-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = archive.read(next(n for n in names if n.endswith("top_level.txt"))).decode().split()
        archive.extractall(tmp_path / "site")
    assert sorted(top_level) == ["hscache", "pipelines", "scorer"]  # no top-level "schemas"
    assert not (tmp_path / "site" / "schemas").exists()
    assert {f"hscache/schemas/{p.name}" for p in (ROOT / "schemas").glob("*.json")} <= set(names)
    assert "hscache/data/default_prompts.jsonl" in names
    shipped = ("builtin/tiny-qwen3.5.safetensors", "builtin/tiny-qwen3.safetensors", "builtin/tokenizer.json")
    shipped += (
        "builtin/training.json",
        "builtin/README.md",
        "prompts/humaneval.jsonl",
        "prompts/mt_bench.jsonl",
    )
    shipped += ("prompts/LICENSE-humaneval.txt", "prompts/LICENSE-mt-bench.txt")
    assert {f"hscache/data/{n}" for n in shipped} <= set(names)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    from hscache.capture.builtin import build_tokenizer

    check = (
        "import hscache; from hscache import schemas; from hscache.capture.prompts import "
        "resolve_prompts, iter_records; assert hscache.__file__.startswith(r'{site}'); "
        # The shipped files as build_builtin reads them (weights digest-checked, tokenizer): building
        # the model from them is the installed transformers' part, not the wheel's (~3 CPU-s more).
        "from hscache.capture.builtin import load_builtin_weights, build_tokenizer; "
        "assert len(load_builtin_weights('builtin:tiny-qwen3.5')) > 0 and len(build_tokenizer()) == {vocab}; "
        "print(len(list(iter_records(resolve_prompts('builtin:default')))), schemas.load_schema('cache_info')['$id'])"
    ).format(site=tmp_path / "site", vocab=len(build_tokenizer()))  # the repo's tokenizer
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=elsewhere, env=env, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["20", "hscache/cache_info/1"]
