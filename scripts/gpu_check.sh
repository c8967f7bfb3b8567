#!/usr/bin/env bash
# Check the GPU path on one GPU: engines alone (generate, weight update, sleep/wake, memory), the
# weight-sync memory probe, and 2 training steps with each engine; prints a pass/fail table.
#   bash scripts/gpu_check.sh [MODEL_DIR]      # any small HF causal-LM folder (default: a random 0.25 GB Qwen2)
# Environment: PYTHON, GPU_CHECK_ENGINES (hf,vllm), GPU_CHECK_DEVICE (cuda; cpu = the same checks on the
# host), GPU_CHECK_OUT (JSON copy of the table), GPU_CHECK_WORK (folder for models, logs, checkpoints).
# Expected output: README.md, "Verify on your GPU". Exit status 1 when a check fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="${ROOT}:${PYTHONPATH:-}"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHON
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"
