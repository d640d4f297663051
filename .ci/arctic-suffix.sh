#!/usr/bin/env bash
# Arctic Inference's suffix tree, the one part of arctic-inference 0.3.0 that vLLM's suffix decoding imports
# (vllm 0.32.0 v1/spec_decode/suffix_decoding.py:25 `from arctic_inference.suffix_decoding import
# SuffixDecodingCache`; config/speculative.py:1597 refuses method "suffix" without the package). The full
# package is source-only and its build pulls CUDA torch; this compiles only csrc/suffix_decoding (the
# nanobind module `_C`, ~10 s) and installs a minimal `arctic_inference` (its empty __init__.py and the
# suffix_decoding subpackage: no vLLM plugin, no CUDA) in a directory of its own, keyed by this script's
# digest and the interpreter, outside the clone. Then:
#   - the vLLM venv (.vllm, built by .ci/vllm-env.sh, whose key this leaves alone) imports it through a
#     .pth file added to its site-packages (the judge serves method "suffix" with it);
#   - the clone gets a `.arctic` link to it (git-ignored): the oracle tests
#     (tests/scorer/test_suffix_oracle.py) import it from the project's venv (same CPython 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
ARCTIC_VERSION=0.3.0
NANOBIND_VERSION=3.1.0
python=.vllm/bin/python
if [ ! -x "$python" ]; then
  echo "no vLLM environment at .vllm: run bash .ci/vllm-env.sh first" >&2
  exit 1
fi
key=$( (cat .ci/arctic-suffix.sh; "$python" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-12)
out_dir="${HSCACHE_ARCTIC_DIR:-$HOME/.cache/hscache/arctic-suffix-$ARCTIC_VERSION-$key}"
if [ ! -f "$out_dir/.complete" ]; then
  rm -rf "$out_dir"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # The sdist (its metadata prepared in vLLM's venv, which has the torch its setup.py imports: an isolated
  # build would install CUDA torch first) and nanobind's wheel (its CMake package; the sdist pins 2.9.2,
  # 3.1.0 is the one the index has and builds the same bindings).
  "$python" -m pip download -q --no-deps --no-build-isolation --no-binary :all: \
    "arctic-inference==$ARCTIC_VERSION" -d "$work/dl"
  "$python" -m pip download -q --no-deps "nanobind==$NANOBIND_VERSION" -d "$work/dl"
  tar xzf "$work/dl/arctic_inference-$ARCTIC_VERSION.tar.gz" -C "$work"
  "$python" -m zipfile -e "$work"/dl/nanobind-*.whl "$work/nanobind"
  src="$work/arctic_inference-$ARCTIC_VERSION"
  PYTHONPATH="$work/nanobind" cmake -S "$src/csrc/suffix_decoding" -B "$work/build" \
    -DPython_EXECUTABLE="$(readlink -f "$python")" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$work/build" -j2 >/dev/null
  mkdir -p "$out_dir/arctic_inference/suffix_decoding"
  cp "$src/arctic_inference/__init__.py" "$out_dir/arctic_inference/"
  cp "$src"/arctic_inference/suffix_decoding/{__init__.py,cache.py} "$out_dir/arctic_inference/suffix_decoding/"
  cp "$work"/build/_C*.so "$out_dir/arctic_inference/suffix_decoding/"
  cp "$src/LICENSE" "$out_dir/"
  touch "$out_dir/.complete"
fi
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$out_dir" > "$site/hscache-arctic-suffix.pth"
ln -sfn "$out_dir" .arctic
echo "Arctic suffix tree: $out_dir ($("$python" -c 'from arctic_inference.suffix_decoding import SuffixDecodingCache; print("imports in vLLM'"'"'s venv")'))"
