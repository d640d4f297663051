"""Fixtures of the crash-safety and verify tests: a small cache cut into many chunk files.

Extraction runs on one torch thread here and in every subprocess these tests start, so an
interrupted-and-resumed run can be compared bit for bit with an uninterrupted one (and the
tiny model is ~7x faster on one thread than on two contended ones).
"""

from __future__ import annotations

import os
import shutil
import socket
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

import hscache
from tests.hscache.forked_cli import CliServer, prefork
from tests.hscache.vllm_jobs import PROMPTS, VLLM_PYTHON, greedy_config, sampled_config

# One subprocess environment for every CLI run of these tests (see module docstring).
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# The CLI server, forked now while pytest collects: torch and hscache imported, no thread started yet
# (forked_cli.py); None where a thread already runs (the fixture then starts a server of its own).
_PREFORKED = prefork(ONE_THREAD_ENV)


@dataclass(frozen=True)
class SmallCache:
    """An uninterrupted reference cache and the settings that built it."""

    path: Path
    config: hscache.ExtractConfig

    def cli_args(self, out: Path) -> list[str]:
        """``hscache extract`` flags equal to ``config`` with ``--out out``."""
        c = self.config
        return [
            "extract",
            "--out",
            str(out),
            "--limit",
            str(c.limit),
            "--max-new-tokens",
            str(c.max_new_tokens),
            "--dtype",
            c.dtype,
            "--layers",
            c.layers,
            "--chunk-mb",
            str(c.chunk_bytes / (1 << 20)),
            "--commit-every-s",
            str(c.commit_every_s),
            "--mtp" if c.mtp else "--no-mtp",
            "--quiet",
        ]

    def copy(self, dest: Path) -> Path:
        shutil.copytree(self.path, dest)
        return dest

    def config_for(self, out: Path, **changes: object) -> hscache.ExtractConfig:
        return replace(self.config, out=str(out), **changes)


@pytest.fixture
def one_thread():
    """Run torch on one thread for the test (restored after): resumed runs must match bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def small_cache(tmp_path_factory: pytest.TempPathFactory) -> SmallCache:
    """12 built-in prompts, 8 greedy tokens, fp32, layers 1,3,5: ~600 tokens in 256-token chunks
    (3 chunk files per hidden-state array), one commit per sequence."""
    out = tmp_path_factory.mktemp("small") / "reference"
    # chunk_bytes 10 KiB rounds up to the 256-token minimum chunk for hidden states and top-k; the
    # 1-D arrays' 2048 tokens are capped at the 1024 that 12 prompts x 8 tokens can write.
    config = hscache.ExtractConfig(
        out=str(out),
        layers="1,3,5",
        max_new_tokens=8,
        dtype="fp32",
        limit=12,
        chunk_bytes=10 * 1024,
        commit_every_s=0.0,
        mtp=False,  # layers exactly 1,3,5 (the MTP head's last layer is tested in tests/scorer/test_mtp.py)
    )
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hscache.extract(config)
    finally:
        torch.set_num_threads(before)
    return SmallCache(out, config)


@pytest.fixture(scope="session")
def cli_server(tmp_path_factory: pytest.TempPathFactory):
    """Forks ``hscache`` CLI runs (in ONE_THREAD_ENV) from one warm interpreter: see forked_cli."""
    server = CliServer({**os.environ, **ONE_THREAD_ENV}, tmp_path_factory.mktemp("cli-runs"), _PREFORKED)
    yield server
    server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory):
    """An empty bucket on a moto server; fake credentials and the endpoint only for the module using it."""
    s3fs = pytest.importorskip("s3fs", reason="pip install s3fs 'moto[server]' to test s3:// caches")
    moto_server = pytest.importorskip("moto.server", reason="pip install 'moto[server]' to test s3:// caches")

    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # moto's backends are process-global: a bucket made by another module's server is still there.
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST"))
    with pytest.MonkeyPatch.context() as env:
        for key, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "HSCACHE_LOCAL_DIR": str(tmp_path_factory.mktemp("local")),
        }.items():
            env.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        # moto keeps its buckets per process, not per server: a later module finds the bucket made.
        s3fs.S3FileSystem().makedirs("hscache-test", exist_ok=True)
        yield "s3://hscache-test"
        s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


# ---- the vLLM extractions (tests/hscache/test_vllm_engine.py, test_vllm_sampled.py) -------------------


@pytest.fixture(scope="session")
def vllm_prompts(tmp_path_factory) -> Path:
    import json

    path = tmp_path_factory.mktemp("vllm-prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="session")
def vllm_extractions(vllm_python, tmp_path_factory, vllm_prompts) -> dict:
    """Every vLLM extraction of these tests in ONE process of vLLM's interpreter
    (tests/hscache/vllm_sampled_run.py): the greedy fp32 tiny-qwen3 cache with the connector's files
    (``greedy``, ``greedy_files``), and the sampled job of test_vllm_sampled.py run whole (``a``) and
    stopped after 3 sequences then resumed (``b``), with what each run returned."""
    import json
    import subprocess

    from hscache.capture.extract import worker_job

    root = tmp_path_factory.mktemp("vllm-extractions")
    greedy = greedy_config(vllm_prompts, root / "greedy", connector_dir=str(root / "greedy-files"))
    sampled = sampled_config(vllm_prompts, root / "a", connector_dir=str(root / "files"))
    jobs = {"greedy.json": greedy, "job.json": sampled}
    for name, config in jobs.items():
        (root / name).write_text(json.dumps(worker_job(config)))
    env = {**os.environ, "PYTHONPATH": str(VLLM_PYTHON.parents[2]), "OMP_NUM_THREADS": "1"}
    runner = Path(__file__).with_name("vllm_sampled_run.py")
    args = [
        root / "job.json",
        root / "b",
        root / "result.json",
        root / "greedy.json",
        root / "greedy-result.json",
    ]
    done = subprocess.run(
        [vllm_python, str(runner), *map(str, args)], capture_output=True, text=True, env=env, timeout=900,
        cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {
        "greedy": root / "greedy", "greedy_files": root / "greedy-files", "a": root / "a", "b": root / "b",
        "prompts": vllm_prompts, **json.loads((root / "result.json").read_text()),
    }  # fmt: skip
