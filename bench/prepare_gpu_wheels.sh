#!/usr/bin/env bash
# Prepare the wheel folder that bench/gpu_check.sh installs on the GPU machine, which reaches no
# package registry. Run it here (PyPI reachable); the folder then travels with the working tree
# through the device tool's `carry` (64 MiB in all; see docs/gpu.md).
#
#   bash bench/prepare_gpu_wheels.sh [DIR]      # default DIR: .gpu-wheels (git-ignored)
#   PY312=/path/to/python3.12 DEV_PYTHON=/path/to/.venv/bin/python bash bench/prepare_gpu_wheels.sh
#
# How: a throw-away CPython 3.12 venv (the device's interpreter) gets stub metadata for what the
# device already has (torch 2.11, transformers 5.17, triton 3.6, numpy, pyarrow, ...). pip resolves
# what we need against those stubs (--dry-run --report: metadata only, no torch download), and the
# closure is downloaded with --no-deps for manylinux x86_64. The same venv then proves the folder
# is complete: an offline `pip install --no-index` of everything into it must succeed.
set -euo pipefail

DIR=${1:-.gpu-wheels}
PY312=${PY312:-$(command -v python3.12 || true)}
if [[ -z "$PY312" ]] || ! "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    py=$(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
    PY312=${py:?"no CPython 3.12 found: set PY312=/path/to/python3.12 (the device runs 3.12)"}
fi
# The project's runtime dependencies the device lacks, the gpu extra, and the test runner.
NEEDED=("setuptools>=77" "zarr>=3.1,<4" "numcodecs>=0.15" "dask[array]>=2024.1" "distributed>=2024.1" "jsonschema>=4.20"
        "flash-linear-attention>=0.3" "pytest>=8")
# Present on the device: never downloaded (torch alone is GBs). Versions of the first three are
# the device's; the others only need to satisfy our lower bounds.
STUBS=("torch 2.11.0" "transformers 5.17.0" "triton 3.6.0" "numpy 2.2.6" "pyarrow 21.0.0" "click 8.2.1"
       "rich 14.1.0" "ml-dtypes 0.5.3" "safetensors 0.6.2" "tokenizers 0.22.1" "huggingface-hub 1.0.0"
       "tensorstore 0.1.76" "xarray 2025.6.1" "pandas 2.3.1")
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform any)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY312" -m venv "$work/venv"
vpy="$work/venv/bin/python"
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for stub in "${STUBS[@]}"; do
    read -r name version <<<"$stub"
    info="$site/${name//-/_}-$version.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$name" "$version" >"$info/METADATA"
    printf 'pip\n' >"$info/INSTALLER"
    : >"$info/RECORD"
done
# Same versions as the tested dev environment where it has them (DEV_PYTHON, default: the
# project's .venv or python3), except for the stubbed packages, which keep the device's versions.
DEV_PYTHON=${DEV_PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
stub_names=$(printf '%s\n' "${STUBS[@]}" | cut -d' ' -f1 | paste -sd'|')
"$DEV_PYTHON" -m pip freeze 2>/dev/null | grep -E '^[A-Za-z0-9_.-]+==' \
    | grep -viE "^(${stub_names//-/[-_]}|hscache)==" >"$work/constraints.txt" || true
"$vpy" -m pip install --quiet --dry-run --report "$work/report.json" --only-binary=:all: \
    -c "$work/constraints.txt" "${NEEDED[@]}"
"$vpy" - "$work/report.json" >"$work/carry.txt" <<'PYEOF'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(f"{item['metadata']['name']}=={item['metadata']['version']}")
PYEOF
echo "carrying $(wc -l <"$work/carry.txt") packages:" $(cat "$work/carry.txt")
mkdir -p "$DIR"
rm -f "$DIR"/*.whl  # a wheel left from an earlier resolution would be a second candidate
"$vpy" -m pip download --quiet --no-deps "${PLATFORM[@]}" -d "$DIR" -r "$work/carry.txt"
cp "$work/carry.txt" "$DIR/requirements.txt"
# The proof: offline, from the folder alone, into the venv that has only the device's packages.
"$vpy" -m pip install --quiet --no-index --find-links "$DIR" -r "$DIR/requirements.txt"
echo "offline install from $DIR into a CPython 3.12 venv: ok"
bytes=$(du -sb "$DIR" | cut -f1)
echo "$DIR: $(ls "$DIR"/*.whl | wc -l) wheels, $((bytes / 1024 / 1024)) MiB ($bytes bytes)"
if ((bytes > 56 * 1024 * 1024)); then
    echo "error: $DIR is over 56 MiB; the device tool carries 64 MiB in all, working tree included" >&2
    exit 1
fi
