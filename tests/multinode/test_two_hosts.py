"""Training across two Ray hosts on one machine (network namespaces A and B, see netns_cluster.py).

Marked ``multinode``: root only, run by ``bash scripts/test.sh --multinode``. One cluster serves
the whole module; the tests run in file order (the node-loss test kills and restarts host B).

1. the tiny CPU ARPO job with trainer.nnodes=2, n_gpus_per_node=1: rank 0 in A, rank 1 in B, the
   gloo group over the veth link, checkpoints from both ranks on the shared filesystem;
2. the last checkpoint merged to Hugging Face gives the live actor's log-probs;
3. host B lost while rank 0 waits for it in a collective: the error names rank 1 and B's address
   (not the survivor that saw the broken connection first); B is restarted;
4. host B lost mid-step: the driver fails within a bounded time naming B's address and the last
   complete checkpoint; B restarts, ``trainer.resume_mode=auto`` continues from that checkpoint and
   finishes with the same step-3 metrics and weights as the uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from netns_cluster import ADDR, IFACE, NS

pytestmark = pytest.mark.multinode

STEPS = 3


def overrides(model_dir, data_dir, out_dir, extra=()) -> list[str]:
    """The tiny CPU ARPO job on two nodes with one worker each, checkpoint every step. Every path is
    absolute and on the filesystem both "hosts" share (a real cluster needs shared storage here)."""
    return [f"ray_init.address={ADDR['a']}:6379", "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
            f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data_dir}/train.parquet",
            f"data.val_files={data_dir}/valid.parquet", f"trainer.default_local_dir={out_dir}",
            "data.max_prompt_length=64", "data.max_response_length=64", "trainer.logger=[jsonl]",
            "actor_rollout_ref.rollout.tools.call_limit=2", "actor_rollout_ref.rollout.seed=3",
            "actor_rollout_ref.rollout.initial_rollouts=2",
            f"actor_rollout_ref.rollout.tools.tool_instances.search.params.cache_file={out_dir}/search.sqlite",
            f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", *extra]


def metrics_by_step(out_dir) -> dict[int, dict]:
    with open(Path(out_dir) / "logs" / "metrics.jsonl") as f:
        return {m["step"]: m for m in map(json.loads, f)}


@pytest.fixture(scope="module")
def full_run(hosts, tool_model_dir, toy_data, tmp_path_factory):
    """An uninterrupted 3-step run across the two hosts (driver in A), through train_and_probe.py.
    Returns its output folder, log text, probe (node infos) and the bytes that crossed the veth."""
    out = tmp_path_factory.mktemp("full")
    log = out.parent / "full.log"
    before = hosts.link_bytes("b")
    start = time.monotonic()
    proc = hosts.popen_in("a", [sys.executable, str(Path(__file__).with_name("train_and_probe.py")), str(out),
                                *overrides(tool_model_dir, toy_data, out)], log)
    try:
        rc = proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    text = log.read_text()
    assert rc == 0, text[-4000:]
    return {"dir": out, "log": text, "probe": json.loads((out / "probe.json").read_text()),
            "veth_bytes": hosts.link_bytes("b") - before, "seconds": time.monotonic() - start}


PLACEMENT = re.compile(r"\[verl_arpo\] worker ranks on nodes: rank 0 on (\S+) \(pid (\d+), GLOO_SOCKET_IFNAME=(\S+)\), "
                       r"rank 1 on (\S+) \(pid (\d+), GLOO_SOCKET_IFNAME=(\S+)\); MASTER_ADDR=(\S+):(\d+)")
VOLATILE = ("timing", "perf/", "time", "cache_")  # wall-clock values, and cache hits (depend on history)


def _same_metrics(ours: dict, reference: dict) -> None:
    for key, value in reference.items():
        if any(v in key for v in VOLATILE):
            continue
        assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def _placement(log: str) -> tuple:
    found = PLACEMENT.search(log)
    assert found, "no placement line in the driver log:\n" + log[-3000:]
    return found.groups()


def _assert_two_hosts(groups: tuple) -> None:
    ip0, _, if0, ip1, _, if1, master, _ = groups
    assert (ip0, ip1) == (ADDR["a"], ADDR["b"])  # one rank per node, rank 0 beside the driver
    assert master == ADDR["a"]  # the gloo rendezvous is A's veth address ...
    assert (if0, if1) == (IFACE["a"], IFACE["b"])  # ... and each rank's gloo device the veth end


def test_training_spans_both_hosts(full_run):
    run = full_run
    infos = run["probe"]["node_infos"]
    assert [(i["rank"], i["ip"], i["netns"]) for i in infos] == [(0, ADDR["a"], NS["a"]), (1, ADDR["b"], NS["b"])]
    assert {i["master_addr"] for i in infos} == {ADDR["a"]}
    assert [i["gloo_socket_ifname"] for i in infos] == [IFACE["a"], IFACE["b"]]
    assert len({i["node_id"] for i in infos}) == 2
    _assert_two_hosts(_placement(run["log"]))
    # FSDP's all-gathers / reduce-scatters between the ranks (and Ray's object transfers) crossed
    # the link: B has no other way to reach A.
    assert run["veth_bytes"] > 1_000_000, run["veth_bytes"]

    metrics = metrics_by_step(run["dir"])
    assert sorted(s for s in metrics if s > 0) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        m = metrics[step]
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, (int, float)))
        assert m["tools/calls"] > 0 and "actor/pg_loss" in m and "actor/grad_norm" in m
    # both ranks wrote their shards into the same checkpoint folder (storage both hosts see)
    assert (run["dir"] / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
    for step in range(1, STEPS + 1):
        actor = run["dir"] / f"global_step_{step}" / "actor"
        assert (actor / "extra_state_rank_0.pt").exists() and (actor / "extra_state_rank_1.pt").exists()
        assert (actor / "checkpoint_meta.json").exists()
    print(f"\n[multinode] 3-step run across two hosts: {run['seconds']:.0f}s, "
          f"{run['veth_bytes'] / 1e6:.1f} MB over the veth")


def test_merged_checkpoint_matches_live_actor(full_run, merge):
    from transformers import AutoModelForCausalLM

    from verl_arpo.utils.torch_functional import logprobs_from_logits

    hf_dir = merge(full_run["dir"] / f"global_step_{STEPS}")
    saved = torch.load(full_run["dir"] / "live.pt")
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    R = saved["responses"].shape[-1]
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"], attention_mask=saved["attention_mask"],
                       position_ids=saved["position_ids"]).logits
    lp = logprobs_from_logits(logits[:, -R - 1:-1], saved["responses"])
    mask = saved["response_mask"].bool()
    assert mask.any()
    assert torch.allclose(lp[mask], saved["live_log_probs"][mask], atol=1e-4)


def test_host_lost_during_a_collective_names_the_lost_host(hosts, tmp_path):
    """Rank 0 (A) waits in an all-reduce for rank 1 (B); B is lost. The survivor's gloo error comes
    first, but the group reports rank 1's death on B (RayWorkerGroup waits peer_failure_grace)."""
    log = tmp_path / "collective.log"
    probe = Path(__file__).with_name("collective_probe.py")
    proc = hosts.popen_in("a", [sys.executable, str(probe), hosts.address], log)
    try:
        _wait_for(lambda: "BLOCKING" in log.read_text(), proc, log, 300, "the blocked all-reduce")
        hosts.kill_host("b")
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    result = json.loads([ln for ln in text.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    assert [(i["rank"], i["ip"]) for i in result["node_infos"]] == [(0, ADDR["a"]), (1, ADDR["b"])]
    error = result["error"]
    assert error and error["type"] == "WorkerGroupError", error
    pid1 = result["node_infos"][1]["pid"]
    assert f"worker rank 1 (node {ADDR['b']}, pid {pid1})" in error["message"], error
    assert "CollectiveWorker.all_reduce_late" in error["message"]
    assert f"first reported as an error on rank 0 (node {ADDR['a']}" in error["message"], error
    assert result["seconds"] < 30, result["seconds"]
    hosts.start_ray("b")
    hosts.wait_for_nodes()


def _driver(hosts, argv_overrides, log_path: Path) -> subprocess.Popen:
    return hosts.popen_in("a", [sys.executable, "-m", "verl_arpo.trainer.main_ppo", "--config-name=cpu_tiny",
                                f"hydra.run.dir={log_path.parent / (log_path.stem + '_hydra')}", *argv_overrides],
                          log_path)


def _wait_for(predicate, proc: subprocess.Popen, log_path: Path, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        assert proc.poll() is None, f"driver exited ({proc.returncode}) before {what}:\n" + log_path.read_text()[-4000:]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}:\n" + log_path.read_text()[-4000:])


def test_node_loss_then_resume(hosts, full_run, tool_model_dir, toy_data, merge, tmp_path):
    cut = tmp_path / "cut"
    args = overrides(tool_model_dir, toy_data, cut, ["trainer.resume_mode=auto"])
    log = tmp_path / "cut.log"
    proc = _driver(hosts, args, log)
    try:
        groups = _wait_for(lambda: PLACEMENT.search(log.read_text()), proc, log, 300, "the placement line").groups()
        _assert_two_hosts(groups)
        rank1_pid = int(groups[4])
        tracker = cut / "latest_checkpointed_iteration.txt"
        _wait_for(lambda: tracker.exists() and tracker.read_text().strip() == "2", proc, log, 300, "checkpoint 2")
        # Step 3 starts right after checkpoint 2 is published and lasts about a second here:
        # freeze rank 1 at once so the loss lands inside the step, then lose the whole host.
        os.kill(rank1_pid, signal.SIGSTOP)
        time.sleep(1.0)
        killed_at = time.monotonic()
        killed = hosts.kill_host("b")
        assert rank1_pid in killed
        rc = proc.wait(timeout=180)
        failed_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc != 0, text[-3000:]
    assert failed_after < 60, failed_after  # bounded: Ray reports the death in seconds
    lost = rf"worker rank 1 \(node {re.escape(ADDR['b'])}, pid {rank1_pid}\) of group \S+ died during"
    assert re.search(lost, text), text[-4000:]
    assert f"training stopped at step 3; last complete checkpoint: {cut / 'global_step_2'}" in text, text[-4000:]
    assert "restart with trainer.resume_mode=auto" in text
    assert tracker.read_text().strip() == "2"
    cut_metrics = metrics_by_step(cut)
    full_metrics = metrics_by_step(full_run["dir"])
    assert sorted(cut_metrics) == [1, 2]
    for step in (1, 2):  # the same run on the same two hosts is deterministic
        _same_metrics(cut_metrics[step], full_metrics[step])

    # the host comes back; the same command continues from the last complete checkpoint
    hosts.start_ray("b")
    hosts.wait_for_nodes()
    log2 = tmp_path / "resume.log"
    proc = _driver(hosts, args, log2)
    try:
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log2.read_text()
    assert rc == 0, text[-4000:]
    assert f"resumed from {cut / 'global_step_2'} (step 2)" in text, text[-3000:]
    _assert_two_hosts(_placement(text))
    assert tracker.read_text().strip() == str(STEPS)
    resumed = metrics_by_step(cut)
    assert sorted(resumed) == [1, 2, 3]
    _same_metrics(resumed[3], full_metrics[3])  # as if B had never been lost

    ours = merge(cut / f"global_step_{STEPS}")
    reference = merge(full_run["dir"] / f"global_step_{STEPS}")
    from safetensors.torch import load_file

    def weights(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    a, b = weights(ours), weights(reference)
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key
    print(f"\n[multinode] node loss reported after {failed_after:.1f}s")
