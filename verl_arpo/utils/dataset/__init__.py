"""RL datasets: `RLHFDataset` over parquet files and its `collate_fn` (verl names)."""
from .rl_dataset import RLHFDataset, collate_fn

__all__ = ["RLHFDataset", "collate_fn"]
