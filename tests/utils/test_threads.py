"""How CPU threads wait (verl_arpo/utils/threads.py): a short spin on an idle machine, asleep on a busy
one or in a worker beside its siblings, the user's choice over ours, and the same numbers either way."""
import os
import subprocess
import sys
import time

import pytest

from verl_arpo.utils.threads import (
    CHOSEN_BY_US,
    CPU_WAIT_VARS,
    IDLE_BELOW_CORES,
    SPIN_WHEN_IDLE,
    busy_cores,
    cpu_thread_env,
    cpu_times,
    wait_env,
)

SPIN = {"GOMP_SPINCOUNT": SPIN_WHEN_IDLE, CHOSEN_BY_US: "auto"}
ASLEEP = {"OMP_WAIT_POLICY": "PASSIVE", CHOSEN_BY_US: "auto"}


def test_the_choice_follows_the_load_and_none_is_asleep():
    assert wait_env(0.0) == wait_env(IDLE_BELOW_CORES - 0.01) == SPIN
    assert wait_env(IDLE_BELOW_CORES) == wait_env(1.7) == ASLEEP
    assert wait_env(None) == ASLEEP          # no /proc/stat: the safe choice


def test_cpu_times_reads_the_per_cpu_lines():
    stat = ("cpu  70 0 30 500 5 0 0 0 0 0\n"
            "cpu0 10 1 2 300 4 1 1 2 9 0\n"      # guest (9) is already inside user: not added
            "cpu1 60 0 20 200 1 0 0 0 0 0\n"
            "cpu12 1 1 1 1 1 1 1 1\n"
            "intr 123 4 5\nctxt 99\ncpufreq 1 2 3 4 5\n")
    assert cpu_times(stat) == {0: (321, 304), 1: (281, 201), 12: (8, 2)}
    assert cpu_times(stat, {1, 5}) == {1: (281, 201)}


def test_busy_cores_sees_two_busy_processes(tmp_path):
    """Two processes that spin, each pinned to one of this process's CPUs: those two CPUs are ~2 cores
    busy, and a process that starts now is told to sleep while it waits."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs and sched_setaffinity")
    pair = sorted(os.sched_getaffinity(0))[:2]
    loops = [subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{c}}})\nwhile True: pass"])
             for c in pair]
    try:
        time.sleep(0.5)
        assert busy_cores(0.5, cpus=set(pair)) >= 1.5
        saved = {k: os.environ.pop(k) for k in (*CPU_WAIT_VARS, CHOSEN_BY_US) if k in os.environ}
        try:
            assert cpu_thread_env() == ASLEEP
        finally:
            os.environ.update(saved)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert busy_cores(stat=tmp_path / "no_such_file") is None


def test_the_users_choice_wins_and_a_stage_keeps_ours(monkeypatch):
    for key in (*CPU_WAIT_VARS, CHOSEN_BY_US):
        monkeypatch.delenv(key, raising=False)
    assert cpu_thread_env() in (SPIN, ASLEEP)                       # chosen from the load now
    assert cpu_thread_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}      # ray_init.runtime_env.env_vars
    assert cpu_thread_env({"GOMP_SPINCOUNT": "10000"}) == {}        # a spin count is a choice too
    assert cpu_thread_env({"GOMP_SPINCOUNT": "10000"}, alone=False) == {}
    # a worker beside its siblings sleeps; 0 spins undo a spin count it would inherit from us
    assert cpu_thread_env(alone=False) == {**ASLEEP, "GOMP_SPINCOUNT": "0"}
    monkeypatch.setenv("GOMP_SPINCOUNT", SPIN_WHEN_IDLE)             # a stage started with our choice...
    monkeypatch.setenv(CHOSEN_BY_US, "auto")
    assert cpu_thread_env() == {}                                   # ...keeps it
    assert cpu_thread_env(alone=False) == {**ASLEEP, "GOMP_SPINCOUNT": "0"}   # its workers sleep
    monkeypatch.delenv(CHOSEN_BY_US)
    assert cpu_thread_env() == cpu_thread_env(alone=False) == {}    # the user's own GOMP_SPINCOUNT
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("KMP_BLOCKTIME", "0")                        # or any of the three
    assert cpu_thread_env() == {}


FORWARD = """
import hashlib, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(2)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(input_ids=torch.randint(3, model.config.vocab_size, (4, 48))).logits
print(hashlib.sha256(logits.numpy().tobytes()).hexdigest())
"""


def test_the_wait_policy_does_not_change_the_numbers(tiny_model_dir):
    """Two threads split the work the same way whether the idle one spins or sleeps: the logits of a
    forward are bit-identical under the default policy, PASSIVE and our short spin (each a fresh
    process: libgomp reads the policy when it loads)."""
    digests = {}
    for policy, chosen in (("default", {}), ("PASSIVE", ASLEEP), ("spin", SPIN)):
        env = {k: v for k, v in os.environ.items() if k not in CPU_WAIT_VARS}
        env.update(chosen)
        out = subprocess.run([sys.executable, "-c", FORWARD.format(model=str(tiny_model_dir))], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        digests[policy] = out.stdout.strip().splitlines()[-1]
    assert digests["default"] == digests["PASSIVE"] == digests["spin"]
    assert len(digests["default"]) == 64


WHEN_TORCH_LOADS = """
import os, runpy, sys
seen = []
class Spy:   # records our wait choice at the moment anything first imports torch
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("VERL_ARPO_CPU_WAIT"))
sys.meta_path.insert(0, Spy())
sys.argv = [{module!r}, "--help"]
try:
    runpy.run_module({module!r}, run_name="__main__")
except SystemExit:
    pass
import torch  # an entry point whose --help loads no torch: the choice must be made by now
print("at torch's import:", seen[0])
"""


@pytest.mark.parametrize("module", ["verl_arpo.trainer.main_sft", "verl_arpo.trainer.main_eval",
                                    "verl_arpo.trainer.main_ppo"])
def test_each_entry_point_chooses_before_torch_loads(module):
    """libgomp reads the wait variables when torch loads it: every command line sets them before."""
    env = {k: v for k, v in os.environ.items() if k not in (*CPU_WAIT_VARS, CHOSEN_BY_US)}
    out = subprocess.run([sys.executable, "-c", WHEN_TORCH_LOADS.format(module=module)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "at torch's import: auto" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
