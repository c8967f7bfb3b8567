"""Shared fixtures: the offline tiny tokenizer/model, built once per test session."""
import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# MKL's code path for fp32 products as every process verl_arpo starts gets it (utils/cpu_blas.py), set
# before this process computes anything: a reference computed in the test's own process then rounds as
# the workers and stages it starts do.
from verl_arpo.utils.cpu_blas import mkl_branch_env  # noqa: E402

os.environ.update(mkl_branch_env())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from verl_arpo.utils.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole session (8 logical CPUs: actors ask for fractions)."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model over-fitted to call tools after the chat prompt of TOOL_PROMPT_USER
    (see verl_arpo.utils.tiny_model.make_tool_model)."""
    from verl_arpo.utils.tiny_model import make_tool_model

    return make_tool_model(tiny_model_dir, tmp_path_factory.mktemp("tool_model"))
