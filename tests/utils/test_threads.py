"""How CPU threads wait (verl_arpo/utils/threads.py): PASSIVE unless the user chose, and the same
numbers either way."""
import os
import subprocess
import sys

from verl_arpo.utils.threads import CPU_WAIT_VARS, cpu_thread_env


def test_threads_sleep_while_they_wait_unless_the_user_chose(monkeypatch):
    for key in CPU_WAIT_VARS:
        monkeypatch.delenv(key, raising=False)
    assert cpu_thread_env() == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert cpu_thread_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}      # ray_init.runtime_env.env_vars
    assert cpu_thread_env({"GOMP_SPINCOUNT": "10000"}) == {}        # a spin count is a choice too
    monkeypatch.setenv("KMP_BLOCKTIME", "0")                        # or this process's environment
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
    forward are bit-identical under the default policy and under PASSIVE (each a fresh process:
    libgomp reads the policy when it loads)."""
    digests = {}
    for policy in ("default", "PASSIVE"):
        env = {k: v for k, v in os.environ.items() if k not in CPU_WAIT_VARS}
        if policy != "default":
            env["OMP_WAIT_POLICY"] = policy
        out = subprocess.run([sys.executable, "-c", FORWARD.format(model=str(tiny_model_dir))], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        digests[policy] = out.stdout.strip().splitlines()[-1]
    assert digests["default"] == digests["PASSIVE"]
    assert len(digests["default"]) == 64
