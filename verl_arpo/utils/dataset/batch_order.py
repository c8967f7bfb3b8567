"""The order in which an epoch visits the training rows (docs/configuration.md, `data.shuffle`,
`data.stratify_by`).

A pure function of (seed, epoch, labels): a resumed run recomputes the same order and so sees
exactly the batches it would have seen.

Stratified order (`data.stratify_by: data_source`): with a small batch drawn from a mix of sources,
a plain shuffle gives steps that are mostly one source (8 prompts from three equal sources: half
the batches hold some source at most once), and each such step pulls the shared policy
towards that source's behaviour. Here every label is spread evenly over the epoch:

    key(row) = (rank of the row among its label's rows + 1/2) / (rows with that label),

the ranks being a random permutation within each label (dataset order without shuffling); the
order sorts the keys. A label with share p of the rows then has B·p rows in a batch of B up to
less than two (tests/data/test_batch_order.py), and exactly B·p when the labels have equal counts
and B is a multiple of their number (8 prompts from three sources: 2 or 3 each; 6 prompts: 2 each).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["epoch_order", "stratified_order"]


def stratified_order(labels: Sequence[Any], rng: np.random.Generator | None) -> np.ndarray:
    """Row indices sorted by the stratified key above; `rng=None` keeps each label's rows in
    dataset order."""
    labels = np.asarray([str(x) for x in labels], dtype=object)
    keys = np.empty(len(labels), dtype=np.float64)
    for label in sorted(set(labels.tolist())):
        rows = np.flatnonzero(labels == label)
        if rng is not None:
            rows = rng.permutation(rows)
        keys[rows] = (np.arange(len(rows)) + 0.5) / len(rows)
    return np.argsort(keys, kind="stable")


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True,
                labels: Sequence[Any] | None = None) -> np.ndarray:
    """The visiting order of `n` rows in `epoch`: seeded by (seed, epoch); stratified by `labels`
    when given (one per row), else a plain permutation (or 0..n-1 without shuffling)."""
    rng = np.random.default_rng([int(seed), int(epoch)]) if shuffle else None
    if labels is not None:
        if len(labels) != n:
            raise ValueError(f"stratified order: {len(labels)} labels for {n} rows")
        return stratified_order(labels, rng)
    return rng.permutation(n) if rng is not None else np.arange(n)
