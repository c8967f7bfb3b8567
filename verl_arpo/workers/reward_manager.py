"""Reward managers: turn a rollout batch into `token_level_scores` with a rule-based scorer.

`NaiveRewardManager(tokenizer, num_examine, compute_score, reward_fn_key)` (verl's name and
arguments). For each row i of a DataProto holding `responses` (B, R) and `attention_mask`
(B, P + R) and/or `response_mask` (B, R):

    valid_i      = attention_mask[i, P:] OR response_mask[i]     (tool results count as valid)
    L_i          = 1 + last index where valid_i == 1              (0 if none)
    text_i       = decode(responses[i, :L_i], skip_special_tokens=True)
                   (multi_turn.format=hermes: responses[i, F_i:L_i], F_i the start of the last
                   assistant turn, after the last tool message: `final_turn_start`)
    s_i          = compute_score(data_source=ds_i, solution_str=text_i,
                                 ground_truth=reward_model_i["ground_truth"], extra_info=ex_i)
    S_i          = last index where response_mask[i] == 1         (the last token the model sampled)
    token_level_scores[i, S_i] = s_i              (float32, shape of `responses`)

The score sits on the last *sampled* token, not the last attended one: a trajectory can end on
tokens with loss mask 0 (the forced EOS at `call_limit`, a tool result cut by the length budget),
and GAE and REINFORCE++ skip masked positions, so a score placed there would vanish from the
returns (docs/algorithms.md, "Rewards"). A row with no sampled token gets no score at all and is
counted in `reward/rows_without_sampled_token`. Without a `response_mask` (verl batches from
other producers) every attended response token counts as sampled.

`compute_score` may return a float or a dict with "score"; the other keys of dicts are gathered
into `reward_extra_info[key]` (one entry per row, None where a row's dict lacks the key).

Scoring runs in a pool of worker processes, bounded by `reward_model.score_timeout`
(`ScoringPool`, scoring_pool.py); this module decides what is scored and where the score goes.

Failures that must not stop or poison a run (docs/algorithms.md, "Rewards"):
- a score that is NaN or ±inf counts as a failed scoring of that sample: it scores 0.0 and is
  counted in `reward/non_finite_scores` (a NaN would spread through its GRPO group into a NaN loss);
- a scorer that hangs ends the run within `score_timeout` seconds (`reward_model.score_timeout`)
  with a `RewardTimeoutError` naming the samples of the chunk still being scored; the stuck worker
  processes are killed. A scorer that cannot be pickled (a lambda) runs in this process, bounded by
  a signal watchdog that works only while the scorer runs Python code (a warning says so).

Departures from verl: the decoded text also covers a trailing tool result (verl counts
`attention_mask` only, which agrees when tool results have attention 1); the score goes on the
last sampled token (above); a scorer exception propagates with a note naming the sample instead
of killing the run silently.
"""
from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from typing import Any
from collections.abc import Callable

import numpy as np
import torch

from verl_arpo.config import JobConfig
from verl_arpo.utils.reward_score import default_compute_score
from verl_arpo.utils.reward_score.custom import (CustomRewardFunction, ScoringFailure,
                                                 load_custom_reward_function)
from verl_arpo.workers.scoring_pool import RewardTimeoutError, ScoringPool

__all__ = ["NaiveRewardManager", "load_custom_reward_function", "get_custom_reward_fn",
           "register_reward_manager", "get_reward_manager_cls", "load_reward_manager",
           "CustomRewardFunction", "RewardTimeoutError"]

logger = logging.getLogger(__name__)

REWARD_MANAGER_REGISTRY: dict[str, type] = {}


def register_reward_manager(name: str) -> Callable[[type], type]:
    """Class decorator: make a reward manager available as `reward_model.reward_manager=name`."""
    def decorator(cls: type) -> type:
        if name in REWARD_MANAGER_REGISTRY and REWARD_MANAGER_REGISTRY[name] is not cls:
            raise ValueError(f"reward manager {name!r} is already registered")
        REWARD_MANAGER_REGISTRY[name] = cls
        return cls
    return decorator


def get_reward_manager_cls(name: str) -> type:
    """The reward manager class registered as `name` (ValueError listing the known names)."""
    if name not in REWARD_MANAGER_REGISTRY:
        raise ValueError(f"unknown reward manager {name!r}; known: {sorted(REWARD_MANAGER_REGISTRY)}")
    return REWARD_MANAGER_REGISTRY[name]


def _job(config: JobConfig) -> JobConfig:
    if not isinstance(config, JobConfig):
        raise TypeError(f"the reward manager takes the typed config, got {type(config).__name__}: build it with "
                        "verl_arpo.trainer.config.validate_config(cfg)")
    return config


def get_custom_reward_fn(config: JobConfig) -> CustomRewardFunction | None:
    """verl's entry point: `config.custom_reward_function.{path,name,reward_kwargs}` -> function.

    Returns None when no path is set (the manager then uses `default_compute_score`).
    """
    section = _job(config).custom_reward_function
    if not section.path:
        return None
    return load_custom_reward_function(section.path, section.name or "compute_score", dict(section.reward_kwargs or {}))


def _score_and_extras(result: Any, index: int) -> tuple[float, dict[str, Any]]:
    if isinstance(result, dict):
        if "score" not in result:
            raise TypeError(f"compute_score returned a dict without 'score' for sample {index}: {sorted(result)}")
        return float(result["score"]), result
    if isinstance(result, (int, float, np.number, bool, np.bool_)):
        return float(result), {}
    raise TypeError(
        f"compute_score must return a float or a dict with 'score'; got {type(result).__name__} for sample {index}"
    )


@register_reward_manager("naive")
class NaiveRewardManager:
    """Score each response with a rule (see the module docstring for the exact rule).

    Args:
        tokenizer: decodes responses (special tokens skipped).
        num_examine: print this many decoded samples per data source per call (0: none).
        compute_score: `f(data_source, solution_str, ground_truth, extra_info)`; default
            `default_compute_score` (dispatch on data source).
        reward_fn_key: non-tensor column holding the data source.
        num_workers: scoring processes for large batches (<= 1: always serial).
        parallel_threshold: minimum batch size for parallel scoring.
        mp_start_method: multiprocessing start method of the pool ("spawn", "forkserver", "fork").
        score_timeout: seconds one batch's scoring may take (None or <= 0: no limit).
    """

    def __init__(self, tokenizer: Any, num_examine: int = 0, compute_score: Callable | None = None,
                 reward_fn_key: str = "data_source", num_workers: int | None = None,
                 parallel_threshold: int = 256, mp_start_method: str = "spawn", score_timeout: float | None = None,
                 solution_span: str = "response", **unused: Any):
        if solution_span not in ("response", "final_turn"):
            raise ValueError(f"solution_span={solution_span!r}; choose response or final_turn")
        self.solution_span = solution_span   # final_turn: the hermes format's last assistant message
        self.tokenizer = tokenizer
        self.num_examine = int(num_examine)
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.num_workers = min(4, os.cpu_count() or 1) if num_workers is None else int(num_workers)
        self.parallel_threshold = int(parallel_threshold)
        self.mp_start_method = mp_start_method
        self.score_timeout = float(score_timeout) if score_timeout and float(score_timeout) > 0 else None
        self.scoring = ScoringPool(self.compute_score, self.num_workers, self.parallel_threshold, mp_start_method,
                                   self.score_timeout)
        if unused:
            logger.info("NaiveRewardManager ignores arguments %s", sorted(unused))

    def score_all(self, items: list[tuple[int, Any, str, Any, Any]]) -> list[Any]:
        """Score (index, data_source, solution_str, ground_truth, extra_info) tuples, in order
        (scoring_pool.py: worker processes, the timeout)."""
        return self.scoring.score_all(items)

    def close(self) -> None:
        """Shut the scoring processes down (they start again on the next batch that needs them)."""
        self.scoring.close()

    @staticmethod
    def valid_response_lengths(data: Any) -> torch.Tensor:
        """L_i: one past the last valid response position (attention_mask OR response_mask)."""
        batch = data.batch
        responses = batch["responses"]
        width = responses.shape[-1]
        valid = torch.zeros_like(responses, dtype=torch.bool)
        keys = set(batch.keys())
        if "attention_mask" in keys and batch["attention_mask"].shape[-1] >= width:
            valid |= batch["attention_mask"][:, -width:].bool()
        if "response_mask" in keys:
            valid |= batch["response_mask"].bool()
        if not ({"attention_mask", "response_mask"} & keys):
            raise KeyError("reward manager needs 'attention_mask' or 'response_mask' in DataProto.batch")
        return _one_past_last(valid)

    @staticmethod
    def score_positions(data: Any) -> torch.Tensor:
        """S_i: index of the last response token the model sampled (response_mask == 1), −1 if none.

        Without `response_mask` the attended response tokens count as sampled (verl's batches)."""
        batch = data.batch
        if "response_mask" in batch.keys():
            sampled = batch["response_mask"].bool()
        elif "attention_mask" in batch.keys():
            sampled = batch["attention_mask"][:, -batch["responses"].shape[-1]:].bool()
        else:
            raise KeyError("reward manager needs 'attention_mask' or 'response_mask' in DataProto.batch")
        return _one_past_last(sampled) - 1

    def _ground_truth(self, data: Any, i: int) -> Any:
        nt = data.non_tensor_batch
        if "reward_model" in nt:
            entry = nt["reward_model"][i]
            if isinstance(entry, dict) and "ground_truth" in entry:
                return entry["ground_truth"]
        if "ground_truth" in nt:
            return nt["ground_truth"][i]
        raise KeyError(f"row {i}: no ground truth (need non_tensor_batch['reward_model'][i]['ground_truth'] "
                       "or non_tensor_batch['ground_truth'])")

    def __call__(self, data: Any, return_dict: bool = False) -> Any:
        """token_level_scores for `data` (a DataProto); with return_dict also reward_extra_info."""
        if "rm_scores" in data.batch.keys():  # a model-based reward was already computed
            scores = data.batch["rm_scores"]
            return {"reward_tensor": scores, "reward_extra_info": {}} if return_dict else scores
        responses = data.batch["responses"]
        n = responses.shape[0]
        lengths = self.valid_response_lengths(data).tolist()
        id_lists = [responses[i, :lengths[i]].tolist() for i in range(n)]
        if self.solution_span == "final_turn" and "response_mask" in data.batch.keys():
            id_lists = [ids[final_turn_start(data.batch["response_mask"][i, :len(ids)].tolist()):] for i, ids in
                        enumerate(id_lists)]
        texts = self.tokenizer.batch_decode(id_lists, skip_special_tokens=True)
        nt = data.non_tensor_batch
        if self.reward_fn_key not in nt:
            raise KeyError(f"non_tensor_batch has no {self.reward_fn_key!r} (reward_fn_key); keys: {sorted(nt)}")
        extra = nt.get("extra_info")
        items = [(i, nt[self.reward_fn_key][i], texts[i], self._ground_truth(data, i),
                  None if extra is None else extra[i]) for i in range(n)]
        results = self.score_all(items)
        failed = [r for r in results if isinstance(r, ScoringFailure)]
        if failed and len(failed) == len(results):   # a broken scorer, not a bad row: stop and say why
            raise RuntimeError(f"the reward function raised on all {n} samples of this batch (first: sample "
                               f"{failed[0].index}, data_source={failed[0].data_source!r}: {failed[0].error}); fix "
                               "custom_reward_function (or the scorer of that data source)")
        if failed:
            logger.warning("the reward function raised on %d of %d samples (first: sample %d, data_source=%r: %s); "
                           "they score 0.0 (metric reward/scorer_errors)", len(failed), n, failed[0].index,
                           failed[0].data_source, failed[0].error)

        reward_tensor = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        positions = self.score_positions(data).tolist()
        per_row: list[dict[str, Any]] = []
        non_finite = []
        for i, result in enumerate(results):
            score, extras = (0.0, {}) if isinstance(result, ScoringFailure) else _score_and_extras(result, i)
            if not math.isfinite(score):  # a failed scoring of this sample, not a poisoned group
                non_finite.append(i)
                score = 0.0
            if positions[i] >= 0:  # else nothing the model sampled can carry it (counted below)
                reward_tensor[i, positions[i]] = score
            per_row.append(extras)
        keys = [k for row in per_row for k in row]
        reward_extra_info: dict[str, list[Any]] = {k: [row.get(k) for row in per_row] for k in dict.fromkeys(keys)}
        self._examine(data, items, results, lengths)
        if non_finite:
            first = items[non_finite[0]]
            logger.warning("%d of %d scores were NaN or infinite (first: sample %d, data_source=%r); scored 0.0",
                           len(non_finite), n, first[0], first[1])
        if return_dict:
            unplaced = sum(p < 0 for p in positions)
            return {"reward_tensor": reward_tensor, "reward_extra_info": reward_extra_info,
                    "reward_metrics": {"reward/rows_without_sampled_token": float(unplaced),
                                       "reward/non_finite_scores": float(len(non_finite)),
                                       "reward/scorer_errors": float(len(failed)),
                                       "reward/serial_fallback_batches": float(self.scoring.serial_fallback)}}
        return reward_tensor

    def _examine(self, data: Any, items: list[tuple], results: list[Any], lengths: list[int]) -> None:
        if self.num_examine <= 0:
            return
        shown: dict[str, int] = defaultdict(int)
        prompts = data.batch["prompts"] if "prompts" in data.batch.keys() else None
        for (i, source, text, truth, _), result in zip(items, results):
            if shown[str(source)] >= self.num_examine:
                continue
            shown[str(source)] += 1
            if prompts is not None:
                ids = prompts[i][data.batch["attention_mask"][i, :prompts.shape[-1]].bool()].tolist() \
                    if "attention_mask" in data.batch.keys() else prompts[i].tolist()
                print("[prompt]", self.tokenizer.decode(ids, skip_special_tokens=True))
            print("[response]", text)
            print("[ground_truth]", truth)
            print("[score]", result)


def _one_past_last(flags: torch.Tensor) -> torch.Tensor:
    """Per row of a [B, R] bool tensor: 1 + the last index holding True (0 for an all-False row)."""
    positions = torch.arange(1, flags.shape[-1] + 1, device=flags.device).expand_as(flags)
    return (positions * flags).max(dim=-1).values


def final_turn_start(mask: list[int]) -> int:
    """Where the last assistant turn begins: after the last loss-mask-0 token (a tool message)
    that precedes the last sampled token (0 when the model never called a tool). The hermes format
    scores this turn only, so an answer quoted in a tool message cannot score."""
    last = max((k for k, v in enumerate(mask) if v), default=-1)
    return max((k for k in range(last) if not mask[k]), default=-1) + 1


def load_reward_manager(config: JobConfig, tokenizer: Any, num_examine: int = 0, **kwargs: Any) -> Any:
    """Build the reward manager named by `config.reward_model.reward_manager` (default "naive").

    Uses `custom_reward_function` when its path is set, `data.reward_fn_key` (default
    "data_source"), and the optional `reward_model.num_workers` / `reward_model.parallel_threshold` /
    `reward_model.score_timeout`.
    """
    job = _job(config)
    reward_cfg = job.reward_model
    cls = get_reward_manager_cls(reward_cfg.reward_manager)
    options = {"reward_fn_key": job.data.reward_fn_key, "parallel_threshold": reward_cfg.parallel_threshold,
               "score_timeout": reward_cfg.score_timeout}
    if reward_cfg.num_workers is not None:  # None: the manager's own choice, min(4, cpu count)
        options["num_workers"] = reward_cfg.num_workers
    if job.actor_rollout_ref.rollout.multi_turn.format == "hermes":   # tool messages are the template's user turns
        options["solution_span"] = "final_turn"
    options.update(kwargs)
    return cls(tokenizer=tokenizer, num_examine=num_examine, compute_score=get_custom_reward_fn(job), **options)
