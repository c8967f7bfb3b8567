"""Checkpoint conversion tools (`python -m merge_ckpt.convert_verl_to_hf --help`)."""
