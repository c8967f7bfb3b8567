#!/usr/bin/env bash
# ARPO on Qwen3-8B (or Qwen2.5-7B-Instruct) in the model's own function-calling format, with the
# sandboxed Python tool and the tools of an MCP server, one node with 8 GPUs (docs/tools.md,
# "Tool-call formats" and "MCP servers").
#   - multi_turn.format=hermes: prompts are rendered by the tokenizer's chat template with the tools'
#     function schemas; the model calls tools as <tool_call>{"name": ..., "arguments": {...}}</tool_call>;
#     results come back as role: tool messages rendered by the same template; branches fork at the
#     tool-message boundaries.
#   - MCP_SERVER_COMMAND: the stdio command of your MCP server, as a Hydra list, e.g.
#     "[python,-m,my_mcp_server]" (or set the instance's params.url for a streamable-HTTP server).
# Fill in the <placeholders> (or export the variables) and run:  bash scripts/ARPO_Qwen3_8B_Hermes_MCP.sh
# Extra arguments are passed on as Hydra overrides, e.g. `--cfg job` to print the config only.
# tests/scripts/test_launch_scripts.py runs this very script for 2 steps on a CPU.
set -euo pipefail
SCRIPT_DIR="$( cd "$( dirname "${BASH_SOURCE[0]}" )" &> /dev/null && pwd )"
PARENT_DIR="$(dirname "$SCRIPT_DIR")"
cd "$PARENT_DIR"

export PYTHONUNBUFFERED=1
export HYDRA_FULL_ERROR=1
export PYTHONPATH="${PARENT_DIR}:${PYTHONPATH:-}"
PYTHON="${PYTHON:-python3}"

PROJECT_NAME="${PROJECT_NAME:-function_calling}"
EXPERIMENT_NAME="${EXPERIMENT_NAME:-ARPO_Qwen3_8B_hermes_mcp}"
NNODES="${NNODES:-1}"
N_GPUS_PER_NODE="${N_GPUS_PER_NODE:-8}"

TRAIN_BATCH_SIZE="${TRAIN_BATCH_SIZE:-64}"
PPO_MINI_BATCH_SIZE="${PPO_MINI_BATCH_SIZE:-16}"
MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-2048}"       # the function schemas are part of the prompt
MAX_RESPONSE_LENGTH="${MAX_RESPONSE_LENGTH:-4096}"
TRAIN_FILES="${TRAIN_FILES:-${PARENT_DIR}/rl_datasets/train.parquet}"
VALID_FILES="${VALID_FILES:-${PARENT_DIR}/rl_datasets/valid.parquet}"
ACTOR_MODEL_PATH="${ACTOR_MODEL_PATH:-<your_model_path>}"   # Qwen3-8B / Qwen2.5-7B-Instruct (a template with tools)
# Qwen3: its template's thinking switch, passed to every render (prompts and tool messages alike)
ENABLE_THINKING="${ENABLE_THINKING:-true}"

ROLLOUT_NAME="${ROLLOUT_NAME:-vllm}"  # vllm | hf
VLLM_SPEED=()
if [ "${ROLLOUT_NAME}" = vllm ]; then
  VLLM_SPEED=(actor_rollout_ref.rollout.enforce_eager=False actor_rollout_ref.rollout.seed_requests=False
              actor_rollout_ref.rollout.max_num_seqs=256 actor_rollout_ref.rollout.calculate_log_probs=False)
fi
ROLLOUT_N="${ROLLOUT_N:-16}"
INITIAL_ROLLOUTS="${INITIAL_ROLLOUTS:-8}"
MCP_SERVER_COMMAND="${MCP_SERVER_COMMAND:-<your_mcp_server_command>}"   # e.g. [python,-m,my_mcp_server]
MCP_TOOLS="${MCP_TOOLS:-null}"        # an allow-list of the server's functions, e.g. [add,lookup]; null: all

TOTAL_EPOCHS="${TOTAL_EPOCHS:-2}"
SAVE_FREQ="${SAVE_FREQ:-5}"
MAX_CKPT_TO_KEEP="${MAX_CKPT_TO_KEEP:-2}"   # each save holds the model and its optimizer state
TEST_FREQ="${TEST_FREQ:-5}"
SAVE_PATH="${SAVE_PATH:-<your_checkpoint_save_dir>/${EXPERIMENT_NAME}}"
LOGGER="${LOGGER:-[console]}"
if [ -n "${WANDB_API_KEY:-}" ]; then
    export WANDB_API_KEY WANDB_DIR="${SAVE_PATH}"
    LOGGER="${LOGGER%]}, wandb]"
fi

case "${ACTOR_MODEL_PATH}${SAVE_PATH}${MCP_SERVER_COMMAND}" in
    *"<"*) echo "Set ACTOR_MODEL_PATH, SAVE_PATH and MCP_SERVER_COMMAND first (edit $0 or export them)" >&2; exit 2 ;;
esac
mkdir -p "$SAVE_PATH"

set -o pipefail
"$PYTHON" -m verl_arpo.trainer.main_ppo \
    --config-path="${PARENT_DIR}/configs" \
    --config-name=ppo_trainer.yaml \
    algorithm.adv_estimator=grpo \
    data.train_files="${TRAIN_FILES}" \
    data.val_files="${VALID_FILES}" \
    data.train_batch_size=${TRAIN_BATCH_SIZE} \
    data.max_prompt_length=${MAX_PROMPT_LENGTH} \
    data.max_response_length=${MAX_RESPONSE_LENGTH} \
    ++data.apply_chat_template_kwargs.enable_thinking=${ENABLE_THINKING} \
    actor_rollout_ref.model.path="${ACTOR_MODEL_PATH}" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${PPO_MINI_BATCH_SIZE} \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((2*(MAX_PROMPT_LENGTH+MAX_RESPONSE_LENGTH))) \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$((4*(MAX_PROMPT_LENGTH+MAX_RESPONSE_LENGTH))) \
    actor_rollout_ref.rollout.name=${ROLLOUT_NAME} \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.7 \
    actor_rollout_ref.rollout.n=${ROLLOUT_N} \
    actor_rollout_ref.rollout.initial_rollouts=${INITIAL_ROLLOUTS} \
    actor_rollout_ref.rollout.beam_size=2 \
    actor_rollout_ref.rollout.branch_probability=0.5 \
    actor_rollout_ref.rollout.entropy_weight=0.2 \
    actor_rollout_ref.rollout.multi_turn.format=hermes \
    '~actor_rollout_ref.rollout.tools.tool_instances.search' \
    +actor_rollout_ref.rollout.tools.tool_instances.mcp.class_path=verl_arpo.workers.rollout.tools.mcp_tool.MCPTool \
    "+actor_rollout_ref.rollout.tools.tool_instances.mcp.params.command=${MCP_SERVER_COMMAND}" \
    +actor_rollout_ref.rollout.tools.tool_instances.mcp.params.name=mcp \
    "+actor_rollout_ref.rollout.tools.tool_instances.mcp.params.tools=${MCP_TOOLS}" \
    +actor_rollout_ref.rollout.tools.tool_instances.mcp.timeout=60 \
    +actor_rollout_ref.rollout.tools.tool_instances.mcp.max_concurrency=16 \
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
    trainer.rollout_data_dir="${SAVE_PATH}/rollout" \
    hydra.run.dir="${SAVE_PATH}/outputs" \
    ${VLLM_SPEED[@]+"${VLLM_SPEED[@]}"} "$@" 2>&1 | tee "${SAVE_PATH}/run.log"
