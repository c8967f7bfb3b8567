#!/bin/bash
# Convert a verl_arpo RL checkpoint (global_step_N) into a Hugging Face model folder.
# Edit the variables below, or set them in the environment:
#   VERL_CHECKPOINT=ckpts/exp/global_step_200 OUTPUT_DIR=hf/exp MODEL_TYPE=qwen3 bash merge_ckpt/convert_checkpoint_from_verl_to_hf_qwen3.sh
# MODEL_TYPE must match the checkpoint's config (qwen2 for Qwen2.5, qwen3 for Qwen3, llama, ...);
# set MODEL_TYPE= (empty) to skip the check. Runs from any directory.
set -euo pipefail

# Configuration
VERL_CHECKPOINT="${VERL_CHECKPOINT:-checkpoints/ARPO_qwen2.5_7b/global_step_200}"
OUTPUT_DIR="${OUTPUT_DIR:-hf_checkpoints/qwen2.5_7b_arpo}"
MODEL_TYPE="${MODEL_TYPE-qwen2}"
PYTHON="${PYTHON:-python}"

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Create output directory
mkdir -p "$OUTPUT_DIR"

# Convert checkpoint
"$PYTHON" "$SCRIPT_DIR/convert_verl_to_hf.py" \
    --verl_checkpoint "$VERL_CHECKPOINT" \
    --output_dir "$OUTPUT_DIR" \
    ${MODEL_TYPE:+--model_type "$MODEL_TYPE"}

echo "Conversion complete: $OUTPUT_DIR"
