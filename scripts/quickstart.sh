#!/usr/bin/env bash
# The main job on the embedded default, from a bare machine: sets up .venv (same as the tests),
# prepares SmolLM2-135M-Instruct and the bundled task if missing, then cold-start SFT → ARPO with a
# Python sandbox and a local search engine → merge to HF → evaluation of base, SFT and RL models.
# Writes outputs/quickstart/summary.json and reward_curve.png. Re-running reuses finished stages.
#
#   bash scripts/quickstart.sh              # the full run: bf16 where the CPU has native bf16 (AMX), else fp32
#                                           # (--precision bf16|fp32 forces one); times and results: docs/results.md
#   bash scripts/quickstart.sh --smoke      # ~3 minutes (~5 from a bare machine): every stage at a plumbing shape
#   bash scripts/quickstart.sh --tiny       # the random tiny model (plumbing only)
#   bash scripts/quickstart.sh --algo aepo  # AEPO instead of ARPO (also: grpo)
#   bash scripts/quickstart.sh --out outputs/lr1e5 actor_rollout_ref.actor.optim.lr=1e-5
#                                           # Hydra overrides of the RL stage (a new --out runs it again)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/setup_env.sh
source "$ROOT/scripts/setup_env.sh"
setup_env
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$VENV/bin/python" -m verl_arpo.quickstart "$@"
