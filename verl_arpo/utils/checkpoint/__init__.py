"""Checkpoints (docs/checkpoints.md): sharded save and load of FSDP2 modules, crash-safe publishing,
offline reading. One module per job:

    layout.py     names, publishing through a staging directory, tracker, cleanup, dataloader state
    manager.py    FSDPCheckpointManager: one module + optimizer + LR schedule + RNG per directory
    offline.py    reading a checkpoint in one process (merge tool, evaluation)
    hf_files.py   Hugging Face weight files (tied keys, sharded safetensors)

Loading never runs code from a checkpoint (utils/checkpoint/safe_load.py); the manifest and the run
lock are in utils/checkpoint/integrity.py.

Layout (directory names as in verl, so scripts and users find things where they expect them):

    <root>/latest_checkpointed_iteration.txt   step of the newest *published* checkpoint
    <root>/global_step_{N}/                    a published checkpoint (never written in place)
        checkpoint_complete.json                marker written just before publishing
        data.pt                                 dataloader state (written by the trainer)
        actor/   critic/                        one `FSDPCheckpointManager` directory each:
            model/  optim/                      torch.distributed.checkpoint (DCP), sharded per rank
            extra_state_rank_{r}.pt             lr scheduler + RNG states of rank r
            huggingface/                        config, generation config, tokenizer (rank 0)
            lora_adapter/adapter_config.json    only for peft LoRA models
            checkpoint_meta.json                written last: the directory is complete
    <root>/.global_step_{N}.partial/           staging directory of a save in progress

Crash safety: a save goes to the staging directory; only after every writer has finished does the
driver fsync it, rename it to `global_step_N` (atomic) and then rewrite the tracker file through a
temporary file and `os.replace` (atomic). A SIGKILL or a full disk at any point leaves at worst a
`.partial` directory, which resume ignores; the previous checkpoint is never touched.

Model keys are the module's own parameter names: HF names for FSDP2 (`fully_shard` adds no prefix)
and plain modules, peft's names for LoRA models (then `checkpoint_meta.json` records `lora`).

Not done here: asynchronous saves, HDFS copies, and reading verl's own FSDP1 sharded files
(`model_world_size_W_rank_R.pt`); checkpoints are written and read in this project's DCP layout.
"""

from verl_arpo.utils.checkpoint.hf_files import save_hf_safetensors, tied_duplicate_keys
from verl_arpo.utils.checkpoint.layout import (COMPLETE_MARKER, CheckpointSaveError, FORMAT, META_FILE, TRACKER_FILE, abort_checkpoint, atomic_write_text, begin_checkpoint, checkpoint_dir, cleanup_old_checkpoints, find_latest_ckpt_path, find_resumable_checkpoint, get_checkpoint_step, is_complete_checkpoint, list_checkpoints, load_dataloader_state, publish_checkpoint, save_dataloader_state, save_failure_message, staging_dir)
from verl_arpo.utils.checkpoint.manager import FSDPCheckpointManager, unwrap_model
from verl_arpo.utils.checkpoint.offline import load_model_state_offline, quiet_single_process, read_checkpoint_meta

__all__ = ["COMPLETE_MARKER", "CheckpointSaveError", "FORMAT", "FSDPCheckpointManager", "META_FILE", "TRACKER_FILE", "abort_checkpoint", "atomic_write_text", "begin_checkpoint", "checkpoint_dir", "cleanup_old_checkpoints", "find_latest_ckpt_path", "find_resumable_checkpoint", "get_checkpoint_step", "is_complete_checkpoint", "list_checkpoints", "load_dataloader_state", "load_model_state_offline", "publish_checkpoint", "quiet_single_process", "read_checkpoint_meta", "save_dataloader_state", "save_failure_message", "save_hf_safetensors", "staging_dir", "tied_duplicate_keys", "unwrap_model"]
