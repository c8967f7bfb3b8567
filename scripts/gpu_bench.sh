#!/usr/bin/env bash
# The GPU measurements of docs/gpu.md in one command (one device lease): the actor update and the
# log-prob pass against a bare PyTorch loop at Qwen2.5-0.5B's and 1.5B's shapes (random weights, every
# attention path: padded, packed sdpa, packed flex_attention, prefix sharing), then gpu_check.sh.
#   bash scripts/gpu_bench.sh OUT_DIR [--skip-check]
# Each step is bounded by its own timeout (GPU_BENCH_TIMEOUT seconds, default 300) so one slow step
# cannot take the others' time, and each bench case by GPU_BENCH_CASE_TIMEOUT (default 150: a case that
# runs out of memory or time is recorded as failed and the next one runs); the bench rewrites its JSON
# after every case, so a step cut short keeps what it measured. Logs and JSON land in OUT_DIR; the exit
# status is 1 when any step failed. GPU_BENCH_DEVICE=cpu runs the same
# steps on the host at the tiny shape (the test of this script). Commit what a GPU run writes as
# benchmarks/results/gpu_check/<device>_<date>_<file> (h200_2026-12-01_actor_update_cuda_qwen2.5-0.5b.json).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:?usage: gpu_bench.sh OUT_DIR [--skip-check]}"
SKIP_CHECK="${2:-}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="${ROOT}:${PYTHONPATH:-}"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
DEVICE="${GPU_BENCH_DEVICE:-cuda}"
LIMIT="${GPU_BENCH_TIMEOUT:-300}"
CASE_LIMIT="${GPU_BENCH_CASE_TIMEOUT:-150}"
status=0

step() {  # step NAME COMMAND...: run it under the time limit, log to OUT_DIR/NAME.log, remember a failure
    local name="$1"; shift
    echo "== $name: $*"
    # the filter's own status is swallowed inside its group, so PIPESTATUS[0] is the step's (an `|| true`
    # after the pipeline would overwrite PIPESTATUS with true's 0 and hide every failure)
    timeout "$LIMIT" "$@" 2>&1 | tee "$OUT_DIR/$name.log" | { grep -v "it/s]" || true; }
    local rc="${PIPESTATUS[0]}"
    [ "$rc" = 0 ] || { echo "== $name: exit $rc"; status=1; }
}

if [ "$DEVICE" = cpu ]; then
    step actor_update_tiny "$PYTHON" "$ROOT/benchmarks/bench_actor_update.py" --shape tiny --quick --cases 3,4,7,8 \
        --case_timeout "$CASE_LIMIT" --out "$OUT_DIR/actor_update_tiny.json"
else
    command -v nvidia-smi >/dev/null || { echo "gpu_bench.sh: no nvidia-smi here: set GPU_BENCH_DEVICE=cpu" >&2; exit 2; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/gpu.txt"
    step actor_update_0.5b "$PYTHON" "$ROOT/benchmarks/bench_actor_update.py" --device cuda --shape qwen2.5-0.5b \
        --case_timeout "$CASE_LIMIT" --out "$OUT_DIR/actor_update_cuda_qwen2.5-0.5b.json"
    # 8,192-token micro-batches: at 16,384 the bare fp32 loop ran out of memory on an H200 (issue 48)
    step actor_update_1.5b "$PYTHON" "$ROOT/benchmarks/bench_actor_update.py" --device cuda --shape qwen2.5-1.5b \
        --micro_tokens 8192 --case_timeout "$CASE_LIMIT" --out "$OUT_DIR/actor_update_cuda_qwen2.5-1.5b.json"
fi
if [ "$SKIP_CHECK" != "--skip-check" ]; then
    GPU_CHECK_DEVICE="$DEVICE" GPU_CHECK_OUT="$OUT_DIR/gpu_check.json" GPU_CHECK_WORK="${TMPDIR:-/tmp}/gpu_check_work" \
        step gpu_check bash "$ROOT/scripts/gpu_check.sh"
fi
exit "$status"
