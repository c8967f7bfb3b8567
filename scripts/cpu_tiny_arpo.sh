#!/usr/bin/env bash
# ARPO end to end on CPU in minutes: the tiny random Qwen2 of verl_arpo.utils.tiny_model, 2 CPU
# worker processes, the transformers (hf) engine, Python + offline BM25 search tools.
# The override list is the one of ARPO_7B_Reasoning_1node.sh with tiny values (configs/cpu_tiny.yaml
# holds the rest: device=cpu, 2 workers, 2 steps).
#   bash scripts/cpu_tiny_arpo.sh                  # build the tiny model (once) and train
#   bash scripts/cpu_tiny_arpo.sh --cfg job        # print the composed config only
# Environment: MODEL_DIR (an existing HF folder skips the build), WORK_DIR, TRAIN_FILES, VALID_FILES,
# PYTHON. Extra arguments are passed on as Hydra overrides.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONPATH="${ROOT}:${PYTHONPATH:-}"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

PROJECT_NAME="cpu_tiny"
EXPERIMENT_NAME="${EXPERIMENT_NAME:-cpu_tiny_arpo}"
CONFIG_PATH="${ROOT}/configs"
CONFIG_NAME="cpu_tiny.yaml"
NNODES=1
N_GPUS_PER_NODE=2                   # CPU worker processes

PROMPT_KEY="prompt"
TRAIN_BATCH_SIZE=2
PPO_MINI_BATCH_SIZE=1
MAX_PROMPT_LENGTH=256
MAX_RESPONSE_LENGTH=128
TRAIN_FILES="${TRAIN_FILES:-${ROOT}/rl_datasets/train.parquet}"
VALID_FILES="${VALID_FILES:-${ROOT}/rl_datasets/valid.parquet}"

WORK_DIR="${WORK_DIR:-${ROOT}/checkpoints/${PROJECT_NAME}/${EXPERIMENT_NAME}}"
MODEL_DIR="${MODEL_DIR:-${WORK_DIR}/tiny_model}"
ACTOR_MODEL_PATH="${MODEL_DIR}"

ROLLOUT_NAME="hf"
ROLLOUT_MODE="sync_with_tool"
ROLLOUT_N=4
INITIAL_ROLLOUTS=2
BEAM_SIZE=2
BRANCH_PROBABILITY=0.5
Entropy_weight=0.2
ENABLE_MULTI_TURN=True
SEARCH_CACHE_PATH="${WORK_DIR}/search_cache.sqlite"
SEARCH_CLASS_PATH="verl_arpo.workers.rollout.tools.local_search_tool.LocalSearchTool"

REWARD_MANAGER="naive"
CUSTOM_REWARD_FUNCTION_PATH=""      # empty: the built-in scorer chosen by each row's data_source
CUSTOM_REWARD_FUNCTION_NAME="compute_score"

TOTAL_EPOCHS=1
SAVE_FREQ=2
TEST_FREQ=-1
SAVE_PATH="${WORK_DIR}"
ROLLOUT_SAVE_PATH="${SAVE_PATH}/rollout"

mkdir -p "$SAVE_PATH" "$ROLLOUT_SAVE_PATH"
if [ ! -f "${MODEL_DIR}/config.json" ]; then
    "$PYTHON" -m verl_arpo.utils.tiny_model "$MODEL_DIR"
fi

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
    actor_rollout_ref.model.use_remove_padding=False \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${PPO_MINI_BATCH_SIZE} \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((2*(MAX_PROMPT_LENGTH+MAX_RESPONSE_LENGTH))) \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$((4*(MAX_PROMPT_LENGTH+MAX_RESPONSE_LENGTH))) \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=${ROLLOUT_NAME} \
    actor_rollout_ref.rollout.mode=${ROLLOUT_MODE} \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.7 \
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
    trainer.logger="[console, jsonl]" \
    trainer.project_name=${PROJECT_NAME} \
    trainer.experiment_name=${EXPERIMENT_NAME} \
    trainer.n_gpus_per_node=${N_GPUS_PER_NODE} \
    trainer.nnodes=${NNODES} \
    trainer.save_freq=${SAVE_FREQ} \
    trainer.test_freq=${TEST_FREQ} \
    trainer.total_epochs=${TOTAL_EPOCHS} \
    trainer.default_local_dir="${SAVE_PATH}" \
    trainer.val_before_train=False \
    trainer.rollout_data_dir="${ROLLOUT_SAVE_PATH}" \
    hydra.run.dir="${SAVE_PATH}/outputs" \
    "$@"
