"""The asynchronous tree rollout, `rollout.mode=async_with_tool` (docs/algorithms.md,
"Asynchronous rollout"). The algorithm is agent_loop.py's (read that first); what changes is
that nothing waits for a round:

    1. budget     m0 (or AEPO's m_i; pre-monitoring itself runs in sync rounds) trajectories
                  per prompt, all queued to the engine at once
    2. generate   the engine batches whatever is queued continuously (`add_requests`/`step`);
                  a trajectory whose generation ends on a tool's stop string starts its tool
                  call on a worker thread while the engine keeps decoding the others
    3. tool       its result (mask 0) is appended as soon as it is in
    4. branch     from the trajectory's *own* ΔH, against its prompt's free slots (never more than n
                  per prompt): under after_result (default) when the round after a tool result
                  ends (the branches fork at that result and are queued at once); under
                  before_call when the tool result comes in (parent and branches queued together)
    5. refill     a prompt whose trajectories have all finished, still short of n, gets a fresh one
    6. output     exactly n per prompt, the same DataProto as sync mode

Reproducibility. Every random draw of a trajectory (its sampling seed per round, its branch
draws) comes from its own stream, seeded with (rollout.seed, step, validate, prompt, trajectory
id, round), and branch ids are derived from the parent's id and round (`p0-t1-r2b0`), so a
trajectory's decisions do not depend on which other trajectory finished first. What can depend on
timing: (a) which sibling takes a prompt's last free slot when two want it (the one whose tool
result arrives first; results that arrive together are taken in trajectory-id order), (b) the
engine's float rounding, which depends on which rows decode together (the engine's seed guarantee
holds up to that), (c) AEPO's consecutive-branch count c_i, which counts branching decisions of a
prompt in the order they happen (sync mode counts rounds). With an engine and tools of fixed
latency the same tree comes back twice (tested). The trees differ from sync mode's for the same
seed (sync draws from one stream in round order).
"""

from __future__ import annotations

import queue
import re
import threading
import time
import zlib

import numpy as np

from verl_arpo.protocol import DataProto
from verl_arpo.utils.progress import Progress
from verl_arpo.workers.rollout.agent_loop import AgentLoop, Trajectory
from verl_arpo.workers.rollout.engines.base import GenRequest, SamplingParams


class AsyncAgentLoop(AgentLoop):
    """AgentLoop without round barriers: trajectories, tools and branches advance independently."""

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        cfg, t0 = self.cfg, time.time()
        # 1. budget, as in sync mode (AEPO's pre-monitoring is a measurement before the rollout: sync rounds)
        validate, n, rule, sampling, prompt_ids, _, groups = self._begin(prompts)
        consecutive = [0] * len(groups)  # AEPO c_i, per prompt, counted over its branching decisions
        by_id: dict[str, Trajectory] = {}
        results: queue.SimpleQueue = queue.SimpleQueue()  # (trajectory, its turn's calls, their results, output)
        in_tool, engine_busy = 0, 0.0
        progress = Progress("validation rollout" if validate else "rollout")

        def start(ts: list[Trajectory]) -> None:
            by_id.update((t.traj_id, t) for t in ts)
            self.engine.add_requests([self._request(t, sampling) for t in ts])

        def finished(t: Trajectory) -> None:   # 5. refill a prompt left without active trajectories
            g = groups[t.prompt_idx]
            if len(g) < n and all(x.done for x in g):
                g.append(self._new_traj(t.prompt_idx, prompt_ids[t.prompt_idx]))
                self._stats["rollout/fresh_refills"] += 1
                start([g[-1]])

        start([t for g in groups for t in g])
        while self.engine.has_unfinished() or in_tool:
            # 2. generate: one engine step; rows that ended leave the batch now
            if self.engine.has_unfinished():
                s = time.perf_counter()
                outputs = self.engine.step()
                engine_busy += time.perf_counter() - s
                for req, out in outputs:
                    t = by_id[req.request_id]
                    calls = self._take_output(t, out)
                    if cfg.entropy_timing == "after_result" and self._due_draw(t):
                        start(self._branch_one(t, groups[t.prompt_idx], rule, consecutive, n))
                    if calls is None:
                        finished(t)
                    else:
                        in_tool += 1
                        self._call_tools(t, calls, out, results)
            # 3–4. tool results that are in (wait for one only when the engine has nothing to do)
            ready = _drain(results, block=in_tool > 0 and not self.engine.has_unfinished())
            for t, calls, rs, out in sorted(ready, key=lambda x: x[0].traj_id):
                in_tool -= 1
                self._take_results(t, calls, rs, out)
                if not t.done and cfg.max_rounds is not None and len(t.round_entropies) >= cfg.max_rounds:
                    t.done, t.finish_reason = True, "max_rounds"
                if t.done:
                    finished(t)
                    continue
                before_call = cfg.entropy_timing == "before_call"
                start([t, *(self._branch_one(t, groups[t.prompt_idx], rule, consecutive, n) if before_call else [])])
            progress(lambda: self._counts(groups), force=all(t.done for g in groups for t in g))

        # 6. exactly n per prompt (as in sync mode), in trajectory-id order (completion order is timing)
        for g in groups:
            g.sort(key=lambda t: _natural(t.traj_id))
        wall = time.time() - t0
        self._stats["rollout/engine_busy_fraction"] = engine_busy / wall if wall > 0 else 0.0
        self._stats["rollout/rounds"] = max((len(t.round_entropies) for g in groups for t in g), default=0)
        return self._finish(prompts, groups, n, t0)

    # ---------------------------------------------------------------------------------------
    def _stream(self, t: Trajectory, purpose: int) -> np.random.Generator:
        """The trajectory's own random stream for its current round (see the module doc)."""
        return np.random.default_rng([*self._key, t.prompt_idx, zlib.crc32(t.traj_id.encode()),
                                      len(t.round_entropies), purpose])

    def _request(self, t: Trajectory, sampling: SamplingParams) -> GenRequest:
        cfg = self.cfg
        seed = int(self._stream(t, 0).integers(2**31 - 1)) if cfg.seed_requests else None
        return GenRequest(request_id=t.traj_id, prompt_ids=t.prompt_ids + t.response_ids,
                          max_new_tokens=cfg.response_length - len(t.response_ids), stop=self.stop_strings,
                          sampling=sampling, parent_id=t.parent_id, seed=seed)

    def _call_tools(self, t: Trajectory, calls: list, out, results: queue.SimpleQueue) -> None:
        """Start a turn's well-formed calls on the executor's threads; the turn's results go to the
        queue together, once the last is in (a malformed call is answered without a tool, as in sync mode)."""
        got: list = [None] * len(calls)
        todo = [j for j, c in enumerate(calls) if c.error is None]
        if not todo:
            results.put((t, calls, got, out))
            return
        left, lock = [len(todo)], threading.Lock()

        def done(j: int, r) -> None:
            got[j] = r
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                results.put((t, calls, got, out))
        for j in todo:
            self.executor.submit(calls[j].tag, calls[j].content, lambda r, j=j: done(j, r))

    def _branch_one(self, t: Trajectory, group: list[Trajectory], rule: str, consecutive: list[int],
                    n: int) -> list[Trajectory]:
        """Step 4 for one trajectory due its draws: up to beam_size − 1 while its prompt has free
        slots, from the trajectory's own stream; branch ids derive from the parent's id and round."""
        i, r = t.prompt_idx, len(t.round_entropies) - 1
        branches = self._draw(t, group, rule, self._stream(t, 1), consecutive[i], n, lambda j: f"{t.traj_id}-r{r}b{j}")
        if rule != "none":
            consecutive[i] = consecutive[i] + 1 if branches else 0
        return branches


def _natural(traj_id: str) -> list:
    """Sort key: numbers inside the id compare as numbers (p0-t2 before p0-t10)."""
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", traj_id)]


def _drain(results: queue.SimpleQueue, block: bool) -> list:
    """Everything in the queue; with `block`, wait for the first item."""
    items = [results.get()] if block else []
    while True:
        try:
            items.append(results.get_nowait())
        except queue.Empty:
            return items
