#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md). On the device machine, from the repository root:
#
#   bash bench/gpu_check.sh             # offline install of .gpu-wheels, then every step;
#                                       # $OUT/gpu_report.json, $OUT/gpu_report.md, $OUT/gpu_check.log
#   bash bench/gpu_check.sh --dry-run   # tiny sizes on the CPU, no installs (tests/bench runs it)
#   bash bench/gpu_check.sh --resume    # a later call on the same (warm) machine: continue after the
#                                       # steps already finished in $WORK (out/gpu_check)
#
# Needs no network: the wheels come from the carried folder (bench/prepare_gpu_wheels.sh makes it;
# WHEELS=... to use another), pip is told never to reach an index.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/out/gpu_check}  # the device tool's result folder: the report is kept there too
WORK=${WORK:-$PWD/out/gpu_check}  # caches and the report, kept between calls for --resume
BUDGET_S=${BUDGET_S:-420}  # no step starts after this; the device command limit is 600 s
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# PEP 668: a system python refuses pip installs without the last one (ignored by older pips).
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PIP_BREAK_SYSTEM_PACKAGES=1
mkdir -p "$OUT"
args=(--out "$WORK" --report-dir "$OUT" --wheels "${WHEELS:-.gpu-wheels}" "$@")
[[ " $* " == *" --dry-run "* ]] || args+=(--budget-s "$BUDGET_S")
# A crash (segfault, CUDA abort) kills the process inside a step: run again with --resume, which
# marks that step crashed and carries on with the steps after it, within what is left of the budget.
for attempt in 1 2 3; do
    "$PY" bench/gpu_check.py "${args[@]}" 2>&1 | tee -a "$OUT/gpu_check.log"
    rc=${PIPESTATUS[0]}
    if ((rc <= 1)); then
        exit "$rc"  # 0: every step ok; 1: some failed or were skipped (the report says which)
    fi
    echo "gpu_check: exit $rc (attempt $attempt); resuming after the step that died" | tee -a "$OUT/gpu_check.log"
    left=$((BUDGET_S - SECONDS))
    args=(--out "$WORK" --report-dir "$OUT" --wheels "${WHEELS:-.gpu-wheels}" "$@" --resume
          --budget-s "$((left > 0 ? left : 0))")
done
exit "$rc"
