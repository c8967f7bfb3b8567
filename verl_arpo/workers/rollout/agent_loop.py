"""The multi-turn tool rollout with ARPO branching and AEPO dynamic budget (docs/algorithms.md,
"ARPO: entropy-based adaptive rollout" and "AEPO 1").

One code path for GRPO, ARPO and AEPO; the branch rule is a switch (see branching.py). Read
`AgentLoop.generate_sequences` top to bottom:

    1. budget     m0 = min(initial_rollouts, n) per prompt, or AEPO's m_i from pre-monitoring
                  (`enable_dynamic_rollouts`)
    2. rounds     every active trajectory generates until EOS, a tool's stop string (`</python>`,
                  `</search>`) or its *own* remaining length budget; its round entropy H_k (the
                  first `entropy_window` tokens of the round) is recorded; the first round sets
                  H_initial = H0_k
    3. tools      the round's tool calls, found by the format (`multi_turn.format`, tool_formats.py):
                  tags, the text between the last `<tag>` and `</tag>` of *this round's generated
                  text*; hermes, every `<tool_call>` JSON of the turn. They run (concurrently), and
                  their results are appended with loss mask 0 (` <result>\\n…\\n</result>`, or the
                  chat template's tool messages). Past `call_limit` the trajectory ends (tags: a
                  forced EOS, mask 0).
    4. branch     for each prompt with free slots, each trajectory due a draw draws up to
                  beam_size−1 times with `branch_rule` (arpo or aepo; ΔH = H_k − H0_k), by
                  `entropy_timing`:
                    after_result  (default; the paper) a trajectory whose round r ≥ 1 (the tokens
                                  after tool result r) just ended: a branch forks at that round's
                                  start, the tool-result boundary, and samples its own round r
                    before_call   (the reference) every active trajectory, with the round that
                                  ended in its latest call; a branch copies the whole state
                  every draw (step, H, H_initial, ΔH, p, outcome) is kept on the trajectory that made it
    5. refill     a prompt with no active trajectory but fewer than n gets one fresh trajectory
    6. output     exactly n trajectories per prompt, grouped by prompt, as a DataProto

Fixes against the reference implementation (listed under "Departures" in docs/algorithms.md): per-trajectory
length budgets; tool content taken from the response only; tool text encoded without special
tokens and unable to produce special-token ids; the forced EOS masked out; base entropies reset
per call and keyed per trajectory; a seeded RNG (`rollout.seed`) for every draw; duplicates
counted in a metric instead of hidden.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from verl_arpo.protocol import DataProto, as_object_array
from verl_arpo.config import RolloutSection
from verl_arpo.utils.progress import Progress
from verl_arpo.utils.torch_functional import compute_position_id_with_mask
from verl_arpo.algos import branching
from verl_arpo.workers.rollout.engines.base import GenRequest, SamplingParams
from verl_arpo.workers.rollout.tool_formats import ToolCall, build_format

logger = logging.getLogger(__name__)
LIMIT_TEXT = "Error: the call limit ({limit} tool calls) was reached; this call was not run."


def active_branch_rule(cfg: RolloutSection) -> str:
    """`branch_rule`, or `none` when no slot can ever be free (m0 = n without pre-monitoring: GRPO)."""
    if not cfg.enable_dynamic_rollouts and branching.initial_rollout_count(cfg.n, cfg.initial_rollouts) >= cfg.n:
        return "none"
    return cfg.branch_rule


@dataclass
class Trajectory:
    """One growing response; a branch is a deep copy that diverges from its next token."""

    traj_id: str
    prompt_idx: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_tool_calls: int = 0
    done: bool = False
    finish_reason: str = ""
    round_entropies: list[float] = field(default_factory=list)
    base_entropy: float | None = None  # H0_k
    delta_entropy: float = 0.0  # ΔH of the latest round
    parent_id: str | None = None
    branch_round: int = -1
    branch_pos: int = -1
    tool_calls: list[dict] = field(default_factory=list)   # each with the round that made it
    messages: list[dict] = field(default_factory=list)     # hermes: the turns as chat messages (sanity check)
    round_starts: list[int] = field(default_factory=list)  # response position where each round began
    draws: list[dict] = field(default_factory=list)  # branch draws made on this trajectory's own rounds
    drawn_round: int = 0  # after_result: the last round that had its draws (round 0 follows no tool result)

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def branch(self, new_id: str) -> "Trajectory":
        """A copy that diverges from the next token; branch_round is the parent's own round index."""
        child = copy.deepcopy(self)
        child.traj_id, child.parent_id = new_id, self.traj_id
        child.branch_round, child.branch_pos = len(self.round_entropies) - 1, len(self.response_ids)
        child.base_entropy, child.delta_entropy = None, 0.0  # a branch records its own H0
        child.draws = []
        return child

    def fork_at_round(self, new_id: str, r: int) -> "Trajectory":
        """after_result: a branch holding the state at round r's start (right after tool result r),
        which samples its own round r. It shares rounds 0..r−1 with its parent, so it keeps
        H_initial, and its round r is not drawn again (the parent drew for that boundary)."""
        child = copy.deepcopy(self)
        pos = self.round_starts[r]
        child.traj_id, child.parent_id, child.branch_round, child.branch_pos = new_id, self.traj_id, r - 1, pos
        child.response_ids, child.loss_mask, child.logprobs = child.response_ids[:pos], child.loss_mask[:pos], child.logprobs[:pos]
        child.round_entropies, child.round_starts = child.round_entropies[:r], child.round_starts[:r]
        child.tool_calls = [c for c in child.tool_calls if c["round"] < r]
        child.messages = [m for m in child.messages if m["round"] < r]
        child.num_tool_calls = len(child.tool_calls)
        child.done, child.finish_reason, child.delta_entropy, child.draws, child.drawn_round = False, "", 0.0, [], r
        return child


class AgentLoop:
    """Drives any `InferenceEngine` and a `ToolExecutor` through multi-turn tool rollouts."""

    def __init__(self, engine, tokenizer, executor, config: RolloutSection, *, call_limit: int, seed: int,
                 chat_template_kwargs: dict | None = None):
        """config: the typed `actor_rollout_ref.rollout` section. call_limit: tool calls per trajectory
        (the tool executor's, which a tool YAML may set). seed: this loop's stream (the worker gives
        rollout.seed × 1000 + rank; the step enters per call). chat_template_kwargs:
        data.apply_chat_template_kwargs (the hermes format renders tool messages with them)."""
        if not isinstance(config, RolloutSection):
            raise TypeError(f"AgentLoop: config is the typed rollout section (config.RolloutSection), got "
                            f"{type(config).__name__}")
        branching.get_branch_rule(config.branch_rule)  # an unknown name fails here, naming the choices
        self.engine, self.tokenizer, self.executor, self.cfg = engine, tokenizer, executor, config
        self.call_limit, self.seed = int(call_limit), int(seed)
        self.format = build_format(config.multi_turn.format, tokenizer, executor, chat_template_kwargs)
        # the turns as chat messages are kept only for the sanity check that reads them
        self._keep_messages = self.format.name == "hermes" and config.multi_turn.tokenization_sanity_check_mode == "strict"
        self.stop_strings = self.format.stop_strings()
        self.eos_id = tokenizer.eos_token_id
        self.engine_eos = set(getattr(engine, "eos_token_ids", None) or [self.eos_id])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tokenizer)

    # ---------------------------------------------------------------------------------------
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        cfg, t0 = self.cfg, time.time()
        # 1. budget: m0 per prompt, or AEPO's entropy pre-monitoring
        validate, n, rule, sampling, prompt_ids, rng, groups = self._begin(prompts)

        # 2–5. rounds until every trajectory is done (or max_rounds)
        consecutive = [0] * len(groups)  # AEPO c_i
        round_idx = 0
        progress = Progress("validation rollout" if validate else "rollout")
        while any(not t.done for g in groups for t in g):
            if cfg.max_rounds is not None and round_idx >= cfg.max_rounds:
                break
            active = [t for g in groups for t in g if not t.done]
            self._run_round(active, sampling, rng)
            gained = self._branch(groups, rule, rng, consecutive, n)
            gained = [g or self._refill(groups[i], prompt_ids[i], n) for i, g in enumerate(gained)]
            consecutive = [c + 1 if g else 0 for c, g in zip(consecutive, gained)]
            round_idx += 1
            progress(lambda: f"round {round_idx}: {self._counts(groups)}", force=all(t.done for g in groups for t in g))

        # 6. exactly n per prompt: cut a round-capped run, duplicate the last one if short
        for g in groups:
            g[:] = [t for t in g if t.done or t.response_ids]  # drop refills that never ran
            for t in g:
                if not t.done:
                    t.done, t.finish_reason = True, "max_rounds"
        self._stats["rollout/rounds"] = round_idx
        return self._finish(prompts, groups, n, t0)

    def _counts(self, groups: list[list[Trajectory]]) -> str:
        """The progress line's counts (both modes)."""
        trajs = [t for g in groups for t in g]
        return (f"{sum(t.done for t in trajs)}/{len(trajs)} trajectories finished, "
                f"{sum(t.num_tool_calls for t in trajs)} tool calls, "
                f"{int(self._stats['rollout/tokens_generated'])} tokens generated")

    def _begin(self, prompts: DataProto):
        """What both rollout modes do first: sampling mode, unpadded prompts, fresh counters and
        step 1 (the budget). Returns (validate, n, rule, sampling, prompt_ids, rng, groups)."""
        cfg, meta = self.cfg, prompts.meta_info
        validate = bool(meta.get("validate", False))
        self._key = [self.seed, int(meta.get("global_steps", 0)), int(validate)]
        rng = np.random.default_rng(self._key)
        n, rule, sampling = self._mode(validate, meta)
        prompt_ids = self._prompt_ids(prompts)
        self._ids = defaultdict(int)
        self._stats: dict[str, float] = defaultdict(float)
        self._round_entropy: dict[int, list[float]] = defaultdict(list)
        if rule != "none" and cfg.enable_dynamic_rollouts:
            budgets = self._pre_monitor(prompt_ids, sampling, rng, n)
        else:
            budgets = [branching.initial_rollout_count(n, cfg.initial_rollouts if rule != "none" else n)] * len(prompt_ids)
        groups = [[self._new_traj(i, ids) for _ in range(m)] for i, (ids, m) in enumerate(zip(prompt_ids, budgets))]
        return validate, n, rule, sampling, prompt_ids, rng, groups

    def _finish(self, prompts: DataProto, groups: list[list[Trajectory]], n: int, t0: float) -> DataProto:
        """Step 6 for both modes: a prompt still short of n duplicates its last trajectory."""
        for g in groups:
            while len(g) < n:
                g.append(g[-1].branch(self._next_id(g[-1].prompt_idx)))
                self._stats["rollout/duplicates"] += 1
        self.engine.release()
        self._stats["timing_s/rollout"] = time.time() - t0
        if self._keep_messages:
            self._sanity_check(prompts, [t for g in groups for t in g])
        return self._to_dataproto(prompts, groups)

    def _sanity_check(self, prompts: DataProto, trajs: list[Trajectory]) -> None:
        """hermes, `tokenization_sanity_check_mode: strict`: each trajectory's ids (built turn by
        turn, what trains) against the ids of its whole conversation rendered in one go by the chat
        template. A mismatch is not an error (the incremental ids are the ones the engine sampled);
        it says where a trainer that re-renders would train other tokens (a template that strips
        `<think>`, a tokenizer that merges across a turn boundary): `rollout/tokenization_mismatch`
        (share of trajectories) and one warning with the first differing position."""
        raw = prompts.non_tensor_batch.get("raw_prompt")
        if raw is None:
            self._stats["rollout/tokenization_unchecked"] = float(len(trajs))   # data.return_raw_chat is off
            return
        bad, first = 0, None
        for t in trajs:
            messages = [*map(dict, raw[t.prompt_idx]), *({k: v for k, v in m.items() if k != "round"} for m in t.messages)]
            want = self.format.full_render_ids(messages)
            have = t.prompt_ids + t.response_ids
            if want[:len(have)] != have:
                bad += 1
                if first is None:
                    pos = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
                    first = (t.traj_id, pos, self.tokenizer.decode(have[max(0, pos - 8):pos + 8]),
                             self.tokenizer.decode(want[max(0, pos - 8):pos + 8]))
        self._stats["rollout/tokenization_mismatch"] = bad / max(1, len(trajs))
        if first is not None:
            logger.warning("tokenization sanity check: %d of %d trajectories differ from a full render of their "
                           "messages; first %s at token %d: trained %r, full render %r (the trained ids are the "
                           "engine's; set multi_turn.tokenization_sanity_check_mode=disable to skip)", bad, len(trajs),
                           *first)

    # ---------------------------------------------------------------------------------------
    def _mode(self, validate: bool, meta: dict) -> tuple[int, str, SamplingParams]:
        cfg = self.cfg
        if validate:
            vk = cfg.val_kwargs
            greedy = not vk.do_sample or float(vk.temperature) <= 0
            sp = SamplingParams(temperature=float(vk.temperature) if not greedy else 1.0,
                                top_p=float(vk.top_p), top_k=int(vk.top_k), greedy=greedy)
            n, rule = int(vk.n), "none"
        else:
            greedy = meta.get("do_sample", True) is False
            sp = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, greedy=greedy)
            n, rule = int(meta.get("n", cfg.n)), active_branch_rule(cfg)
        sp.logprobs_topk = cfg.entropy_topk if cfg.entropy_mode == "topk_proxy" else 0
        sp.full_entropy = cfg.entropy_mode == "full"
        sp.stats_window = cfg.entropy_window  # the branch rule reads no statistics past it
        sp.logprobs = cfg.calculate_log_probs
        return n, rule, sp

    @staticmethod
    def _prompt_ids(prompts: DataProto) -> list[list[int]]:
        """The prompts' token ids, unpadded: the dataset's `raw_prompt_ids` (what the trainer sends),
        else (a verl caller that sends padded tensors, main_eval) `input_ids` where the mask is 1."""
        raw = prompts.non_tensor_batch.get("raw_prompt_ids")
        if raw is not None:
            return [[int(t) for t in ids] for ids in raw]
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
        return [row[m].tolist() for row, m in zip(ids, mask)]

    def _padded_prompts(self, prompts: DataProto, trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt half of the training layout, a row per trajectory ([B, P] ids and mask,
        left-padded): the caller's tensors when it sent them, else each trajectory's prompt ids
        left-padded to rollout.prompt_length (the dataset's width, data.max_prompt_length) or to the
        longest prompt if one is longer."""
        if prompts.batch is not None and "input_ids" in prompts.batch.keys():
            rows = torch.tensor([t.prompt_idx for t in trajs], dtype=torch.long)
            return prompts.batch["input_ids"][rows], prompts.batch["attention_mask"][rows]
        width = max([int(self.cfg.prompt_length)] + [len(t.prompt_ids) for t in trajs])
        ids = torch.full((len(trajs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(trajs), width), dtype=torch.long)
        for i, t in enumerate(trajs):
            ids[i, width - len(t.prompt_ids):] = torch.tensor(t.prompt_ids, dtype=torch.long)
            mask[i, width - len(t.prompt_ids):] = 1
        return ids, mask

    def _next_id(self, prompt_idx: int) -> str:
        k = self._ids[prompt_idx]
        self._ids[prompt_idx] += 1
        return f"p{prompt_idx}-t{k}"

    def _new_traj(self, prompt_idx: int, ids: list[int], prefix: str = "") -> Trajectory:
        # pre-monitoring trajectories (prefix) are named apart so real ones always start at t0
        traj_id = f"{prefix}p{prompt_idx}" if prefix else self._next_id(prompt_idx)
        return Trajectory(traj_id=traj_id, prompt_idx=prompt_idx, prompt_ids=ids)

    # ---------------------------------------------------------------------------------------
    def _run_round(self, active: list[Trajectory], sampling: SamplingParams, rng: np.random.Generator,
                   max_new: int | None = None, tools: bool = True) -> None:
        """One generation round for `active`, then their tool calls (steps 2–3)."""
        cfg = self.cfg
        requests = [GenRequest(request_id=t.traj_id, prompt_ids=t.prompt_ids + t.response_ids,
                               max_new_tokens=min(max_new or cfg.response_length, cfg.response_length - len(t.response_ids)),
                               stop=self.stop_strings if tools else [], sampling=sampling, parent_id=t.parent_id,
                               seed=int(rng.integers(2**31 - 1)) if cfg.seed_requests else None)
                    for t in active]
        outputs = self.engine.generate(requests)
        turns = [(t, calls, out) for t, out in zip(active, outputs) if (calls := self._take_output(t, out, tools))]
        if turns:
            self._execute(turns)

    def _take_output(self, t: Trajectory, out, tools: bool = True) -> list[ToolCall] | None:
        """Append one round's generated tokens and entropy to `t`; return its tool calls (the
        format's parse), or None when the trajectory ended (EOS, length, call limit)."""
        cfg = self.cfg
        self._stats["rollout/tokens_generated"] += len(out.token_ids)
        t.round_starts.append(len(t.response_ids))
        t.append(list(out.token_ids), 1, list(out.logprobs) if cfg.calculate_log_probs else None)
        h = branching.round_entropy(out, cfg.entropy_mode, self.vocab_size, cfg.entropy_window)
        t.round_entropies.append(h)
        t.base_entropy = h if t.base_entropy is None else t.base_entropy
        t.delta_entropy = h - t.base_entropy
        self._round_entropy[len(t.round_entropies) - 1].append(h)
        room = cfg.response_length - len(t.response_ids)
        calls = self.format.parse(out) if tools else None
        if self._keep_messages:
            self._record_turn(t, out)
        if calls is None:
            t.done, t.finish_reason = True, out.finish_reason
        elif room <= 0:  # the call closed exactly at the budget: no room for a result
            t.done, t.finish_reason = True, "length"
        elif t.num_tool_calls >= self.call_limit:
            if self.format.forced_eos:
                t.append([self.eos_id], 0)  # forced, not sampled: loss mask 0
            t.done, t.finish_reason = True, "call_limit"
        else:
            left = self.call_limit - t.num_tool_calls   # a turn's calls past the limit are answered, not run
            return [c if k < left else ToolCall(c.tag, c.content, c.name, LIMIT_TEXT.format(limit=self.call_limit))
                    for k, c in enumerate(calls)]
        return None

    def _execute(self, turns: list[tuple[Trajectory, list[ToolCall], object]]) -> None:
        """Run every well-formed call of every turn in one concurrent batch, then append each turn's results."""
        todo = [(k, j, c) for k, (_, calls, _) in enumerate(turns) for j, c in enumerate(calls) if c.error is None]
        results = self.executor.execute_batch([(c.tag, c.content) for _, _, c in todo]) if todo else []
        by_call = {(k, j): r for (k, j, _), r in zip(todo, results)}
        for k, (t, calls, out) in enumerate(turns):
            self._take_results(t, calls, [by_call.get((k, j)) for j in range(len(calls))], out)

    def _take_results(self, t: Trajectory, calls: list[ToolCall], results: list, out) -> None:
        """Append a turn's tool results (mask 0) to `t`; a None result is a call answered without a
        tool (empty, malformed, past the limit), with its error text."""
        texts = [r.text if r is not None else c.error for c, r in zip(calls, results)]
        t.num_tool_calls += len(calls)
        room = self.cfg.response_length - len(t.response_ids)
        # [reliability: tests/reliability/README.md] encode only what the budget can hold (a 10 MB tool output took
        # tens of seconds to tokenise); `shown` becomes the (sanitised) part the trajectory holds
        ids, shown = self.format.render_results(calls, texts, room, out)
        r_idx = len(t.round_entropies) - 1
        for c, r, text in zip(calls, results, shown):
            t.tool_calls.append({**c.record, "result": text, "round": r_idx,
                                 "seconds": r.seconds if r is not None else 0.0, "ok": bool(r is not None and r.ok),
                                 "infra": bool(r is not None and r.infra)})   # the service failed, not the model
            if self._keep_messages:
                t.messages.append({"role": "tool", "name": c.name, "content": text, "round": r_idx})
        t.append(ids[:room], 0)
        if len(ids) >= room:
            t.done, t.finish_reason = True, "length"

    def _record_turn(self, t: Trajectory, out) -> None:
        """hermes: the turn as an assistant message (its text without the EOS), for the sanity check."""
        ids = [i for i in out.token_ids if i not in self.engine_eos]
        t.messages.append({"role": "assistant", "round": len(t.round_entropies) - 1,
                           "content": self.tokenizer.decode(ids, skip_special_tokens=False)})

    # ---------------------------------------------------------------------------------------
    def _branch(self, groups: list[list[Trajectory]], rule: str, rng: np.random.Generator,
                consecutive: list[int], n: int) -> list[bool]:
        """Step 4 (sync): the draws of every trajectory due one, prompt by prompt, in group order."""
        gained = [False] * len(groups)
        for i, group in enumerate(groups):
            for t in [t for t in group if self._due_draw(t)]:
                gained[i] |= bool(self._draw(t, group, rule, rng, consecutive[i], n, lambda j, i=i: self._next_id(i)))
        return gained

    def _due_draw(self, t: Trajectory) -> bool:
        """before_call: every active trajectory after each round. after_result: a trajectory whose
        latest round r ≥ 1 (generated after tool result r) has not drawn yet, finished or not."""
        if self.cfg.entropy_timing == "before_call":
            return not t.done
        return len(t.round_entropies) - 1 > t.drawn_round

    def _draw(self, t: Trajectory, group: list[Trajectory], rule: str, rng: np.random.Generator, consecutive: int,
              n: int, new_id) -> list[Trajectory]:
        """Up to beam_size − 1 draws for `t` while its prompt has free slots (both modes). `new_id(j)`
        names the j-th draw's branch. Each draw is recorded on `t` with what decided it."""
        cfg, after = self.cfg, self.cfg.entropy_timing == "after_result"
        decide, r = branching.get_branch_rule(rule), len(t.round_entropies) - 1
        if after:
            t.drawn_round = r
        children = []
        for j in range(cfg.beam_size - 1):
            if len(group) >= n:
                break
            self._stats["rollout/branch_draws"] += 1  # the rule's chances: branches / draws = its fire rate
            d = decide(rng, t.delta_entropy, consecutive, branch_probability=cfg.branch_probability,
                       entropy_weight=cfg.entropy_weight, penalty_gamma=cfg.branch_penalty_gamma)
            child = None
            if d.fired:
                child = t.fork_at_round(new_id(j), r) if after else t.branch(new_id(j))
                group.append(child)
                children.append(child)
                self._stats["rollout/branches"] += 1
            self._stats["rollout/branch_draws_zero_dh"] += t.delta_entropy == 0.0
            self._stats["rollout/branch_p_sum"] += d.p
            self._stats["rollout/branch_abs_dh_sum"] += abs(t.delta_entropy)
            # step t: the tool result the entropy follows (after_result) or the call that ended the round
            t.draws.append({"step": r if after else t.num_tool_calls, "round": r, "h": t.round_entropies[r],
                            "h_initial": t.base_entropy, "delta_h": t.delta_entropy, "p": d.p, "u": d.u,
                            "branched": bool(d.fired), "child": child.traj_id if child else None})
        return children

    def _refill(self, group: list[Trajectory], prompt_ids: list[int], n: int) -> bool:
        """Step 5: one fresh trajectory for a prompt with no active trajectory and fewer than n."""
        if len(group) >= n or any(not t.done for t in group):
            return False
        group.append(self._new_traj(group[0].prompt_idx, prompt_ids))
        self._stats["rollout/fresh_refills"] += 1
        return True

    def _pre_monitor(self, prompt_ids: list[list[int]], sampling: SamplingParams, rng: np.random.Generator,
                     n: int) -> list[int]:
        """AEPO step 1: m_i from H_root (a short generation) and H̄ (one full tool-using rollout)."""
        cfg = self.cfg
        short = [self._new_traj(i, ids, prefix="pm-root-") for i, ids in enumerate(prompt_ids)]
        self._run_round(short, sampling, rng, max_new=cfg.initial_entropy_tokens, tools=False)
        full = [self._new_traj(i, ids, prefix="pm-full-") for i, ids in enumerate(prompt_ids)]
        round_idx = 0
        while any(not t.done for t in full) and (cfg.max_rounds is None or round_idx < cfg.max_rounds):
            self._run_round([t for t in full if not t.done], sampling, rng)
            round_idx += 1
        budgets = []
        for root, traj in zip(short, full):
            h_mean = float(np.mean(traj.round_entropies)) if traj.round_entropies else root.round_entropies[0]
            budgets.append(branching.dynamic_initial_rollouts(n, root.round_entropies[0], h_mean, cfg.dynamic_rollout_beta))
        self._stats["rollout/pre_monitor_tool_calls"] = sum(t.num_tool_calls for t in full)
        self._stats["rollout/initial_rollouts_mean"] = float(np.mean(budgets))
        self._round_entropy.clear()  # pre-monitoring rounds are not the training rollout's
        self.engine.release()
        return budgets

    # ---------------------------------------------------------------------------------------
    def _to_dataproto(self, prompts: DataProto, groups: list[list[Trajectory]]) -> DataProto:
        """Step 6: n trajectories per prompt, grouped by prompt (matches `repeat(n, interleave=True)`)."""
        R = self.cfg.response_length
        trajs = [t for g in groups for t in g]
        prompt_tokens, prompt_mask = self._padded_prompts(prompts, trajs)
        responses = torch.full((len(trajs), R), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((len(trajs), R), dtype=torch.long)
        resp_attn = torch.zeros((len(trajs), R), dtype=prompt_mask.dtype)
        logprobs = torch.zeros((len(trajs), R), dtype=torch.float32)
        for k, t in enumerate(trajs):
            L = len(t.response_ids)
            responses[k, :L] = torch.tensor(t.response_ids, dtype=torch.long)
            response_mask[k, :L] = torch.tensor(t.loss_mask, dtype=torch.long)
            resp_attn[k, :L] = 1
            logprobs[k, :L] = torch.tensor(t.logprobs, dtype=torch.float32) * response_mask[k, :L]
        attention_mask = torch.cat([prompt_mask, resp_attn], dim=-1)
        tensors = {
            "prompts": prompt_tokens, "responses": responses,
            "input_ids": torch.cat([prompt_tokens, responses], dim=-1),
            "attention_mask": attention_mask, "position_ids": compute_position_id_with_mask(attention_mask),
            "response_mask": response_mask,
        }
        if self.cfg.calculate_log_probs:   # verl's key: only when the mismatch metrics or TIS read them
            tensors["rollout_log_probs"] = logprobs
        non_tensors = {
            "traj_id": as_object_array([t.traj_id for t in trajs]),
            "parent_id": as_object_array([t.parent_id for t in trajs]),
            "branch_round": np.array([t.branch_round for t in trajs], dtype=object),
            "branch_pos": np.array([t.branch_pos for t in trajs], dtype=object),
            "num_tool_calls": np.array([t.num_tool_calls for t in trajs], dtype=object),
            "round_entropies": as_object_array([list(t.round_entropies) for t in trajs]),
            "tool_calls": as_object_array([list(t.tool_calls) for t in trajs]),
            "branch_decisions": as_object_array([list(t.draws) for t in trajs]),
            "finish_reason": as_object_array([t.finish_reason for t in trajs]),
        }
        if "uid" in prompts.non_tensor_batch:
            non_tensors["uid"] = as_object_array([prompts.non_tensor_batch["uid"][t.prompt_idx] for t in trajs])
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors,
                                   meta_info={"metrics": self._metrics(trajs)})

    def _metrics(self, trajs: list[Trajectory]) -> dict[str, float]:
        m = dict(self._stats)
        draws = m.pop("rollout/branch_draws", 0.0)
        p_sum, dh_sum = m.pop("rollout/branch_p_sum", 0.0), m.pop("rollout/branch_abs_dh_sum", 0.0)
        if draws:   # what steered the draws: a p pinned at branch_probability means the entropy did not
            m["rollout/branch_draws"] = draws
            m["rollout/branch_p_mean"] = p_sum / draws
            m["rollout/branch_abs_delta_h_mean"] = dh_sum / draws
        in_traj = sum(sum(t.loss_mask) for t in trajs)
        m["rollout/tokens_in_trajectories"] = float(in_traj)
        m["rollout/generated_per_traj_token"] = m.get("rollout/tokens_generated", 0.0) / max(1, in_traj)
        m["tools/calls_per_traj"] = float(np.mean([t.num_tool_calls for t in trajs])) if trajs else 0.0
        for k, hs in sorted(self._round_entropy.items()):
            m[f"rollout/entropy/round_{k}"] = float(np.mean(hs))
        first = self._round_entropy.get(0, [])
        later = [h for k, hs in self._round_entropy.items() if k > 0 for h in hs]
        if first:
            m["rollout/entropy/before_tools"] = float(np.mean(first))
        if later:
            m["rollout/entropy/after_tools"] = float(np.mean(later))
        if hasattr(self.format, "metrics"):
            m.update(self.format.metrics(reset=True))
        if self.executor is not None and hasattr(self.executor, "metrics"):
            # per-call window: counts belong to this rollout, so a resumed run reports the same numbers
            m.update({k: float(v) for k, v in self.executor.metrics(reset=True).items() if isinstance(v, (int, float))})
        return m
