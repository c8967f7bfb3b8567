"""verl_arpo turns transformers' Hub kernels off unless the user turns them on (verl_arpo/__init__.py;
docs/environment.md, `USE_HUB_KERNELS`): a model loaded after `import verl_arpo` is not kernelized, and an
explicit USE_HUB_KERNELS=YES is left as the user set it. Each case runs in a fresh interpreter, since
the default is set at import."""
import json
import os
import subprocess
import sys

import pytest
import transformers

PROBE = """
import json, os, sys
import verl_arpo  # noqa: F401  (sets the default)
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1])
m.train()
print(json.dumps({"env": os.environ.get("USE_HUB_KERNELS"), "use_kernels": bool(getattr(m, "use_kernels", False))}))
"""


def _probe(model_dir, env_value):
    env = {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}
    if env_value is not None:
        env["USE_HUB_KERNELS"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE, str(model_dir)], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_hub_kernels_are_off_by_default(tiny_model_dir):
    assert _probe(tiny_model_dir, None) == {"env": "NO", "use_kernels": False}


def test_a_users_explicit_choice_is_kept(tiny_model_dir):
    got = _probe(tiny_model_dir, "YES")
    assert got["env"] == "YES"
    try:
        import kernels  # noqa: F401
    except ImportError:
        pytest.skip("no `kernels` package: transformers cannot kernelize, whatever the variable says")
    if not hasattr(transformers.PreTrainedModel, "use_kernels"):
        pytest.skip(f"transformers {transformers.__version__} has no Hub kernels")
    assert got["use_kernels"] is True   # transformers >= 5.25 kernelizes by default when the user allows it
