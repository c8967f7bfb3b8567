#!/usr/bin/env bash
# ARPO on Qwen3-14B, deep search (web search + Python; GAIA / HLE validation), one node with 8 GPUs.
# Same overrides as the reference's ARPO deep-search scripts, run by verl_arpo (deep-research preset). Fill in the
# <placeholders> (or export the variables) and run:  bash scripts/ARPO_14B_DeepSearch_1node.sh
# Extra arguments are passed on as Hydra overrides, e.g. `--cfg job` to print the config only.
# Paths, sizes (TRAIN_BATCH_SIZE, ROLLOUT_N, MAX_RESPONSE_LENGTH, ...) and the engine can be exported
# too; tests/scripts/test_launch_scripts.py runs this very script for 2 steps on a CPU that way.
set -euo pipefail
SCRIPT_DIR="$( cd "$( dirname "${BASH_SOURCE[0]}" )" &> /dev/null && pwd )"
PARENT_DIR="$(dirname "$SCRIPT_DIR")"
cd "$PARENT_DIR"
echo "Switched to parent directory: $PARENT_DIR"

# ============================ Environment Setup ============================
export PYTHONUNBUFFERED=1
export HYDRA_FULL_ERROR=1
# (the reference exported VLLM_ATTENTION_BACKEND=XFORMERS, a vLLM V0 workaround that current vLLM rejects)
export VERL_LOGGING_LEVEL=DEBUG
export MKL_SERVICE_FORCE_INTEL=1
export MKL_THREADING_LAYER=GNU
export RAY_memory_usage_threshold=0.8
export RAY_memory_monitor_refresh_ms=0
export PYTHONPATH="${PARENT_DIR}:${PYTHONPATH:-}"
PYTHON="${PYTHON:-python3}"

# ============================ Basic Configuration ============================
PROJECT_NAME="${PROJECT_NAME:-deep_research}"
EXPERIMENT_NAME="${EXPERIMENT_NAME:-arpo_qwen3_14b_deepsearch}"
CONFIG_PATH="${CONFIG_PATH:-${PARENT_DIR}/configs}"   # absolute path of the config folder
CONFIG_NAME="${CONFIG_NAME:-ppo_trainer_dr.yaml}"
NNODES="${NNODES:-1}"
N_GPUS_PER_NODE="${N_GPUS_PER_NODE:-8}"

# ============================ Data Configuration ============================
PROMPT_KEY="prompt"                 # prompt column
TRAIN_BATCH_SIZE="${TRAIN_BATCH_SIZE:-64}" # prompts per step
PPO_MINI_BATCH_SIZE="${PPO_MINI_BATCH_SIZE:-8}" # prompts per optimizer step
MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-2000}"
MAX_RESPONSE_LENGTH="${MAX_RESPONSE_LENGTH:-6192}"
TRAIN_FILES="${TRAIN_FILES:-${PARENT_DIR}/rl_datasets/hard_search_1k.parquet}"
VALID_FILES="${VALID_FILES:-[${PARENT_DIR}/rl_datasets/gaia_test.parquet,${PARENT_DIR}/rl_datasets/hle_test.parquet]}"

# ============================ Model Configuration ============================
ACTOR_MODEL_PATH="${ACTOR_MODEL_PATH:-<your_14B_model_path>}"   # Hugging Face folder (SFT checkpoint)
USE_REMOVE_PADDING="${USE_REMOVE_PADDING:-True}"           # packed sequences (needs flash-attn)
SP_SIZE="${SP_SIZE:-1}"                                      # Ulysses sequence parallel size: GPUs that split one trajectory (docs/sequence_parallel.md)

# ============================ Rollout Configuration ==========================
ROLLOUT_NAME="${ROLLOUT_NAME:-vllm}"  # vllm | hf
# vLLM at verl's speed (docs/gpu.md, "GPU defaults"): CUDA graphs (the in-place weight reload keeps
# their storage), vLLM's batched sampler (branch draws stay seeded; tokens follow vLLM's stream),
# verl's 256 concurrent sequences. The hf engine has none of these settings.
VLLM_SPEED=()
if [ "${ROLLOUT_NAME}" = vllm ]; then
  VLLM_SPEED=(actor_rollout_ref.rollout.enforce_eager=False actor_rollout_ref.rollout.seed_requests=False
              actor_rollout_ref.rollout.max_num_seqs=256 actor_rollout_ref.rollout.calculate_log_probs=False)
fi
ROLLOUT_MODE="sync_with_tool"        # multi-turn tool loop
ROLLOUT_N="${ROLLOUT_N:-16}"         # trajectories per prompt
INITIAL_ROLLOUTS="${INITIAL_ROLLOUTS:-8}" # ARPO: independent trajectories; branches fill up to n
BEAM_SIZE=2                          # branches per high-entropy round: beam_size - 1
BRANCH_PROBABILITY=0.5
Entropy_weight=0.2
ENABLE_MULTI_TURN=True

# ============================ Rollout Tools Configuration ==========================
# node-local disk: SQLite on NFS (a checkout often is) corrupts; point it at a shared local path to keep it
SEARCH_CACHE_PATH="${SEARCH_CACHE_PATH:-${TMPDIR:-/tmp}/verl_arpo/search_cache.sqlite}"
SEARCH_CLASS_PATH="${SEARCH_CLASS_PATH:-verl_arpo.workers.rollout.tools.search_tool.BingSearchTool}"  # needs BRIGHTDATA_API_KEY / BRIGHTDATA_ZONE

# ============================ Reward Configuration ==========================
REWARD_MANAGER="naive"
CUSTOM_REWARD_FUNCTION_PATH="${CUSTOM_REWARD_FUNCTION_PATH:-${PARENT_DIR}/verl_arpo/utils/reward_score/deep_research.py}"
CUSTOM_REWARD_FUNCTION_NAME="compute_score"

# ============================ Training Configuration ============================
TOTAL_EPOCHS="${TOTAL_EPOCHS:-5}"
SAVE_FREQ="${SAVE_FREQ:-5}"
MAX_CKPT_TO_KEEP="${MAX_CKPT_TO_KEEP:-2}"   # a save holds the model and its optimizer state (91-177 GB at 14B): keep the latest two
TEST_FREQ="${TEST_FREQ:-5}"

# ============================ Path Configuration ============================
SAVE_PATH="${SAVE_PATH:-<your_checkpoint_save_dir>/${EXPERIMENT_NAME}}"
ROLLOUT_SAVE_PATH="${SAVE_PATH}/rollout"

# ============================ WandB Configuration ============================
# export WANDB_API_KEY=... before running (never written into this file); empty = console only.
LOGGER="${LOGGER:-[console]}"      # e.g. LOGGER="[console, jsonl]": metrics.jsonl under the checkpoint folder
if [ -n "${WANDB_API_KEY:-}" ]; then
    export WANDB_API_KEY WANDB_DIR="${SAVE_PATH}"
    LOGGER="${LOGGER%]}, wandb]"
fi

case "${ACTOR_MODEL_PATH}${SAVE_PATH}" in
    *"<"*) echo "Set ACTOR_MODEL_PATH and SAVE_PATH first (edit $0 or export them)" >&2; exit 2 ;;
esac
mkdir -p "$SAVE_PATH" "$ROLLOUT_SAVE_PATH"

# ============================ Start Training ============================
set -o pipefail
"$PYTHON" -m verl_arpo.trainer.main_ppo \
    --config-path="$CONFIG_PATH" \
    --config-name="$CONFIG_NAME" \
    algorithm.adv_estimator=grpo \
    algorithm.kl_ctrl.kl_coef=0.0 \
    data.train_files="${TRAIN_FILES}" \
    data.val_files="${VALID_FILES}" \
    data.prompt_key=${PROMPT_KEY} \
    data.train_batch_size=${TRAIN_BATCH_SIZE} \
    data.max_prompt_length=${MAX_PROMPT_LENGTH} \
    data.max_response_length=${MAX_RESPONSE_LENGTH} \
    actor_rollout_ref.model.path="${ACTOR_MODEL_PATH}" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.model.use_remove_padding=${USE_REMOVE_PADDING} \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=${SP_SIZE} \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${PPO_MINI_BATCH_SIZE} \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((2*(MAX_PROMPT_LENGTH+MAX_RESPONSE_LENGTH))) \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$((4*(MAX_PROMPT_LENGTH+MAX_RESPONSE_LENGTH))) \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=${ROLLOUT_NAME} \
    actor_rollout_ref.rollout.mode=${ROLLOUT_MODE} \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.75 \
    actor_rollout_ref.rollout.n=${ROLLOUT_N} \
    actor_rollout_ref.rollout.initial_rollouts=${INITIAL_ROLLOUTS} \
    actor_rollout_ref.rollout.beam_size=${BEAM_SIZE} \
    actor_rollout_ref.rollout.branch_probability=${BRANCH_PROBABILITY} \
    actor_rollout_ref.rollout.entropy_weight=${Entropy_weight} \
    actor_rollout_ref.rollout.tools.tool_instances.search.params.cache_file="${SEARCH_CACHE_PATH}" \
    actor_rollout_ref.rollout.tools.tool_instances.search.class_path=${SEARCH_CLASS_PATH} \
    actor_rollout_ref.rollout.multi_turn.enable=${ENABLE_MULTI_TURN} \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$((4*(MAX_PROMPT_LENGTH+MAX_RESPONSE_LENGTH))) \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    reward_model.reward_manager=${REWARD_MANAGER} \
    custom_reward_function.path="${CUSTOM_REWARD_FUNCTION_PATH}" \
    custom_reward_function.name=${CUSTOM_REWARD_FUNCTION_NAME} \
    trainer.critic_warmup=0 \
    trainer.logger="${LOGGER}" \
    trainer.project_name=${PROJECT_NAME} \
    trainer.experiment_name=${EXPERIMENT_NAME} \
    trainer.n_gpus_per_node=${N_GPUS_PER_NODE} \
    trainer.nnodes=${NNODES} \
    trainer.save_freq=${SAVE_FREQ} \
    trainer.test_freq=${TEST_FREQ} \
    trainer.total_epochs=${TOTAL_EPOCHS} \
    trainer.max_actor_ckpt_to_keep=${MAX_CKPT_TO_KEEP} \
    trainer.default_local_dir="${SAVE_PATH}" \
    trainer.val_before_train=False \
    trainer.rollout_data_dir="${ROLLOUT_SAVE_PATH}" \
    hydra.run.dir="${SAVE_PATH}/outputs" \
    ${VLLM_SPEED[@]+"${VLLM_SPEED[@]}"} "$@" 2>&1 | tee "${SAVE_PATH}/run.log"
