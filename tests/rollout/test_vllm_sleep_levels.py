"""VLLMEngine's sleep/wake/sync order on a device with vLLM sleep mode (CUDA), checked without one:
the engine drives a recording stand-in for `vllm.LLM` (vLLM's sleep mode does not exist on the CPU,
so this is the fake-device check; gpu_check.sh runs the real one on a GPU, docs/gpu.md)."""
import pytest

from verl_arpo.workers.rollout.engines.vllm_engine import VLLMEngine


class RecordingLLM:
    def __init__(self):
        self.calls = []

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs=None):
        streamed = [name for name, _ in kwargs["weights_iterator"]]  # consumed, as vLLM's workers do
        self.calls.append(("collective_rpc", method, streamed))


def _engine(level):
    """A VLLMEngine whose vLLM is the recorder (built without vLLM: only the state the sleep path reads)."""
    eng = VLLMEngine.__new__(VLLMEngine)
    eng.llm, eng.sleep_mode, eng.sleep_level = RecordingLLM(), True, level
    eng._asleep = eng._weights_awake = eng._discarded = False
    eng._names, eng._known, eng._tied = None, None, False
    return eng


def test_level_two_discards_the_weights_until_a_full_sync_refills_them():
    import torch

    eng = _engine(2)
    eng.sleep()
    assert eng.llm.calls == [("reset_prefix_cache",), ("sleep", 2)]
    assert eng.weights_discarded and eng.discard_weights()
    with pytest.raises(RuntimeError, match="discarded by a level-2 sleep"):
        eng.wake()  # never generate from discarded weights
    eng.llm.calls.clear()
    eng.update_weights([("model.embed_tokens.weight", torch.zeros(2)), ("lm_head.weight", torch.ones(2))])
    # the weights wake alone for the sync (no KV cache beside the gathered parameters), then refill
    assert eng.llm.calls[:2] == [("wake_up", ["weights"]),
                                 ("collective_rpc", "reload_weights", ["model.embed_tokens.weight", "lm_head.weight"])]
    assert not eng.weights_discarded
    eng.llm.calls.clear()
    eng.wake()
    assert eng.llm.calls == [("wake_up", ["kv_cache"])]  # the KV cache last, after the sync


def test_level_one_keeps_the_weights_and_wakes_everything_at_once():
    eng = _engine(1)
    eng.sleep()
    assert ("sleep", 1) in eng.llm.calls and not eng.weights_discarded and not eng.discard_weights()
    eng.llm.calls.clear()
    eng.wake()
    assert eng.llm.calls == [("wake_up", None)]


def test_sleep_level_is_checked():
    with pytest.raises(ValueError, match="sleep_level=3"):
        VLLMEngine("/nonexistent", sleep_level=3)
