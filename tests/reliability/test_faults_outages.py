"""Issue 51, item 4: a tool *outage* (its service down, rate-limited past its retries, a call past its
timeout) is told apart from the model's own errors, retried with backoff, and then kept out of the
loss by `actor_rollout_ref.rollout.tools.infra_failure_policy`; past `infra_failure_stop_rate` the
run stops after a checkpoint, with one line naming the tool. Real HTTP servers on 127.0.0.1."""
import time

import numpy as np
import pytest
import torch
from rel_helpers import FakeSearchAPI, prompts
from test_faults_tools import _loop, _search_tool, _storm

from verl_arpo.protocol import DataProto, as_object_array
from verl_arpo.algos.core_algos import compute_grpo_outcome_advantage
from verl_arpo.trainer.ppo.tool_outages import apply_outage_policy, infra_failures, outage_stop_message, share_failed
from verl_arpo.workers.rollout.tools.base_tool import BaseTool
from verl_arpo.workers.rollout.tools.registry import ToolExecutor


class _Raises(BaseTool):
    name = trigger_tag = "python"

    def __init__(self, exc):
        self.exc, self.calls = exc, 0

    def run(self, content):
        self.calls += 1
        raise self.exc


def test_the_executor_tells_outages_from_the_models_errors():
    refused = _Raises(ConnectionRefusedError(111, "Connection refused"))
    ex = ToolExecutor({"python": refused}, timeout=10, retry_count=2, retry_backoff=0.01)
    r = ex.execute("python", "print(1)")
    assert not r.ok and r.infra and refused.calls == 3        # retried with backoff, then an outage
    bug = _Raises(ValueError("bad input"))
    r = ToolExecutor({"python": bug}, timeout=10, retry_count=1, retry_backoff=0.01).execute("python", "x")
    assert not r.ok and not r.infra                             # the tool's (or the model's) error: text to learn from
    m = ex.metrics()
    assert m["tools/python/infra_failures"] == 1 and m["tools/infra_failures"] == 1


def test_a_search_server_killed_and_restarted_mid_step(rel_tok, tmp_path):
    """The server dies while the rollout runs: its calls end as outages (flagged infra); after a
    restart on the same port the next step's calls succeed. A 429 storm that ends within the
    retries is no outage at all."""
    api = FakeSearchAPI()
    executor = ToolExecutor({"search": _search_tool(api, tmp_path, retry_backoff=0.02)}, max_workers=8, timeout=20,
                            retry_count=1, retry_backoff=0.02)
    turns = [[f"<search>topic {i}</search>", f"<search>more {i}</search>"] for i in range(3)]
    loop = _loop(rel_tok, executor, turns, n=2, response_length=400)
    first = {"n": 0}

    def kill_after_first(i, headers, body):       # the first request is answered, then the server goes away
        first["n"] += 1
        if first["n"] == 1:
            return 200, {"organic": [{"description": "ok"}]}, {}
        api.server.shutdown()
        return 503, {"error": "going down"}, {}
    api.responder = kill_after_first
    out = loop.generate_sequences(prompts(rel_tok, ["a", "b", "c"]))
    api.server.server_close()
    calls = [c for row in out.non_tensor_batch["tool_calls"] for c in row]
    assert sum(c["ok"] for c in calls) >= 1 and any(c["infra"] for c in calls)
    assert all(c["infra"] == (not c["ok"]) for c in calls)      # every failure here is the service's
    # restart on the same port: the next step's calls succeed, none is an outage
    time.sleep(0.2)
    api2 = FakeSearchAPI(port=api.port)
    try:
        out = loop.generate_sequences(prompts(rel_tok, ["a", "b", "c"], step=1))
        calls = [c for row in out.non_tensor_batch["tool_calls"] for c in row]
        assert calls and all(c["ok"] and not c["infra"] for c in calls)
        # 429 then 200 within the tool's retries: a result, no outage
        api2.responder = _storm(until=time.monotonic() + 0.05, statuses=(429,))
        r = executor.execute("search", "after the storm")
        assert r.ok and not r.infra
    finally:
        api2.close()
        executor.close()


def _batch(scores, groups, infra_rows):
    n, R = len(scores), 6
    calls = [[{"tag": "search", "ok": i not in infra_rows, "infra": i in infra_rows}] for i in range(n)]
    rewards = torch.zeros(n, R)
    rewards[:, 3] = torch.tensor(scores, dtype=torch.float32)
    return DataProto.from_dict(tensors={"response_mask": torch.ones(n, R, dtype=torch.long), "token_level_rewards": rewards},
                               non_tensors={"uid": as_object_array(groups), "tool_calls": as_object_array(calls)})


def test_mask_takes_the_trajectory_out_of_the_loss_and_its_groups_baseline():
    scores, groups = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], ["a", "a", "a", "b", "b", "b"]
    batch = _batch(scores, groups, infra_rows={1})
    m = apply_outage_policy(batch, "mask")
    assert m["tools/infra_failed_trajectories"] == 1 and m["tools/infra_masked_trajectories"] == 1
    assert batch.batch["response_mask"][1].sum() == 0 and batch.batch["response_mask"][[0, 2, 3]].sum() == 18
    assert list(batch.non_tensor_batch["excluded_reason"]) == ["", "tool_outage_masked", "", "", "", ""]
    adv, _ = compute_grpo_outcome_advantage(batch.batch["token_level_rewards"], batch.batch["response_mask"],
                                            batch.non_tensor_batch["uid"])
    # by hand: group a without row 1 is {1.0, 0.0}: mean 0.5, std (unbiased) 0.7071
    assert adv[0, 0].item() == pytest.approx(0.5 / np.std([1.0, 0.0], ddof=1), rel=1e-4)
    assert adv[2, 0].item() == pytest.approx(-0.5 / np.std([1.0, 0.0], ddof=1), rel=1e-4)


def test_drop_group_keep_and_the_stop_line():
    batch = _batch([1.0, 0.0, 1.0, 0.0], ["a", "a", "b", "b"], infra_rows={3})
    m = apply_outage_policy(batch, "drop_group")
    assert m["tools/infra_dropped_groups"] == 1 and m["tools/infra_dropped_trajectories"] == 2
    assert batch.batch["response_mask"][:2].sum() == 12 and batch.batch["response_mask"][2:].sum() == 0
    assert list(batch.non_tensor_batch["excluded_reason"])[2:] == ["tool_outage_group_dropped"] * 2
    kept = _batch([1.0, 0.0], ["a", "a"], infra_rows={0})
    assert apply_outage_policy(kept, "keep")["tools/infra_failed_trajectories"] == 1
    assert kept.batch["response_mask"].sum() == 12 and list(kept.non_tensor_batch["uid"]) == ["a", "a"]
    assert share_failed(infra_failures(kept)) == 0.5
    line = outage_stop_message(infra_failures(kept), 0.5, 0.25, 7, "/ckpt/global_step_6")
    assert "step 7: 50%" in line and "search (1 trajectories)" in line and "infra_failure_stop_rate=0.25" in line
    assert "/ckpt/global_step_6" in line and "trainer.resume_mode=auto" in line
    with pytest.raises(ValueError, match="infra_failure_policy"):
        apply_outage_policy(kept, "ignore")


def test_past_the_stop_rate_the_trainer_saves_then_stops():
    """The decision in the trainer (a stand-in object holds only what `_tool_outages` reads): past
    the rate it saves the previous step's model once, then raises the one-line error; below it,
    the policy is applied and counted."""
    from types import SimpleNamespace

    from verl_arpo.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl_arpo.trainer.ppo.tool_outages import ToolOutageError

    saved = []
    tools = SimpleNamespace(infra_failure_stop_rate=0.4, infra_failure_policy="mask")
    trainer = SimpleNamespace(config=SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(tools=tools))),
                              last_checkpoint="/ckpt/global_step_2")

    def save(step):
        saved.append(step)
        trainer.last_checkpoint = f"/ckpt/global_step_{step}"
    trainer.save_checkpoint = save
    with pytest.raises(ToolOutageError, match=r"step 5: 50% .*Last checkpoint: /ckpt/global_step_4"):
        RayPPOTrainer._tool_outages(trainer, _batch([1.0, 0.0], ["a", "a"], infra_rows={0}), 5, {})
    assert saved == [4]
    metrics = {}
    RayPPOTrainer._tool_outages(trainer, _batch([1.0, 0.0, 1.0], ["a", "a", "a"], infra_rows={0}), 6, metrics)
    assert saved == [4] and metrics["tools/infra_masked_trajectories"] == 1


def test_a_run_whose_tool_never_answers_stops_with_exit_6_naming_it(tool_model_dir, tmp_path):
    """Every Python call outlives the executor's timeout (a tool that never returns, bounded by it):
    the run stops at step 1 with one line naming the tool, exit code 6, no traceback."""
    import subprocess

    from rel_helpers import write_tool_task
    from test_faults_training import ROOT, _cmd, _env

    (tmp_path / "data").mkdir()
    data = write_tool_task(tmp_path / "data", rows=4)
    cmd = _cmd(tool_model_dir, data, tmp_path / "out", "actor_rollout_ref.rollout.tools.timeout=0.001",
               "actor_rollout_ref.rollout.tools.infra_failure_stop_rate=0.01")
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 6, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("[verl_arpo] tool outage at step 1:") and "python (" in last and "(exit 6)" in last, \
        proc.stderr[-3000:]
    # the driver prints no traceback; a Ray worker that the stop's SIGTERM catches inside a weakref
    # callback prints Ray's own "Exception ignored ... sigterm_handler" lines (prefixed with its actor
    # name), which say nothing about the outage's handling (seen once in a loaded suite, 2026-12-06)
    driver = [ln for ln in proc.stderr.splitlines() if "ActorRolloutRefWorker pid=" not in ln]
    assert "Last checkpoint: none" in last and not any("Traceback" in ln for ln in driver), proc.stderr[-3000:]
