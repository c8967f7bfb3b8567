"""Epoch order: the plain permutation is unchanged; the stratified one spreads every label evenly."""
from collections import Counter

import numpy as np
import pytest

from verl_arpo.utils.dataset.batch_order import epoch_order


def batches(order, labels, size):
    return [Counter(labels[i] for i in order[k * size:(k + 1) * size]) for k in range(len(order) // size)]


def test_without_labels_it_is_the_seeded_permutation():
    # the order earlier runs (and their checkpoints) used: resuming them must see the same batches
    assert epoch_order(50, 1, 3).tolist() == np.random.default_rng([1, 3]).permutation(50).tolist()
    assert epoch_order(7, 1, 0, shuffle=False).tolist() == list(range(7))


def test_three_equal_sources_give_every_batch_its_share():
    labels = ["math"] * 200 + ["search"] * 200 + ["multi"] * 200
    order = epoch_order(600, 1, 0, labels=labels)
    assert sorted(order.tolist()) == list(range(600))
    assert all(c == {"math": 2, "search": 2, "multi": 2} for c in batches(order, labels, 6))
    assert all(sorted(c.values()) in ([2, 3, 3],) for c in batches(order, labels, 8))
    # a plain shuffle of the same rows leaves some batch of 8 with a source at most once
    plain = epoch_order(600, 1, 0)
    assert min(min(c.get(x, 0) for x in ("math", "search", "multi")) for c in batches(plain, labels, 8)) <= 1


def test_random_mixes_stay_within_two_rows_of_their_share():
    worst = 0.0
    for seed in range(60):
        rng = np.random.default_rng(seed)
        sizes = rng.integers(1, 50, size=rng.integers(1, 5))
        labels = [f"l{i}" for i, s in enumerate(sizes) for _ in range(s)]
        labels = [labels[i] for i in rng.permutation(len(labels))]
        n = len(labels)
        order = epoch_order(n, seed, 0, labels=labels)
        assert sorted(order.tolist()) == list(range(n))
        for size in range(1, min(n, 16) + 1):
            for count in batches(order, labels, size):
                for i, s in enumerate(sizes):
                    worst = max(worst, abs(count.get(f"l{i}", 0) - size * s / n))
    assert worst < 2.0


def test_seeded_reproducible_and_random_within_a_label():
    labels = ["a"] * 30 + ["b"] * 10
    first = epoch_order(40, 5, 2, labels=labels)
    assert first.tolist() == epoch_order(40, 5, 2, labels=labels).tolist()
    assert first.tolist() != epoch_order(40, 5, 3, labels=labels).tolist()  # a new epoch, a new order
    a_rows = [i for i in first if labels[i] == "a"]
    assert a_rows != sorted(a_rows)
    # without shuffling each label keeps dataset order, still interleaved 3:1
    fixed = epoch_order(40, 5, 2, shuffle=False, labels=labels).tolist()
    assert [i for i in fixed if labels[i] == "a"] == list(range(30))
    assert all(sorted(c.values()) == [1, 3] for c in batches(fixed, labels, 4))


def test_label_count_must_match():
    with pytest.raises(ValueError, match="3 labels for 4 rows"):
        epoch_order(4, 0, 0, labels=["a", "b", "a"])


def _trainer(model_dir, tok, overrides):
    from hydra import compose, initialize_config_dir

    from verl_arpo.trainer.config import validate_config
    from verl_arpo.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl_arpo.utils.dataset import RLHFDataset

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    with initialize_config_dir(config_dir=str(root / "configs"), version_base=None):
        cfg = compose(config_name="cpu_tiny", overrides=[f"actor_rollout_ref.model.path={model_dir}",
                                                         "data.max_prompt_length=384", "data.val_files=null",
                                                         "trainer.logger=[]", *overrides])
    job = validate_config(cfg)
    return RayPPOTrainer(job, tok, RLHFDataset(job.data.train_files, tok, job.data), None, None, None)


def test_the_trainer_draws_stratified_batches_of_the_bundled_task(tiny_model_dir, tiny_tokenizer):
    trainer = _trainer(tiny_model_dir, tiny_tokenizer, ["data.train_batch_size=6", "data.stratify_by=data_source"])
    sources = trainer.train_dataset.column("data_source")
    seen = []
    for step in range(1, trainer.steps_per_epoch + 2):  # into the second epoch
        rows = trainer._batch_indices(step).tolist()
        assert sorted(Counter(sources[i] for i in rows).values()) == [2, 2, 2]
        seen += rows if step <= trainer.steps_per_epoch else []
    assert sorted(seen) == list(range(len(sources)))  # an epoch visits every row once
    plain = _trainer(tiny_model_dir, tiny_tokenizer, ["data.train_batch_size=6"])
    assert plain._batch_indices(1).tolist() == np.random.default_rng([1, 0]).permutation(len(sources))[:6].tolist()
    with pytest.raises(ValueError, match="data.stratify_by='task'"):
        _trainer(tiny_model_dir, tiny_tokenizer, ["data.stratify_by=task"])
