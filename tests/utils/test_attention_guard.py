"""`without_cudnn_attention`: cuDNN's SDPA flag off inside on CUDA, restored after (even on an
error), the other kernels' flags untouched; on the CPU it changes nothing."""
import pytest
import torch

from verl_arpo.utils.device import without_cudnn_attention

FLAGS = (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.flash_sdp_enabled,
         torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.math_sdp_enabled)


def flags():
    return [f() for f in FLAGS]


def test_cuda_turns_only_cudnn_off_and_restores_it_even_on_error():
    before = flags()
    assert before[0], "cuDNN attention is on by default (what the guard exists for)"
    torch.backends.cuda.enable_mem_efficient_sdp(False)   # a user's own choice
    try:
        with without_cudnn_attention("cuda"):
            assert flags() == [False, before[1], False, before[3]]
            with without_cudnn_attention(torch.device("cuda", 0)):   # nested: the outer state comes back
                assert flags()[0] is False
            assert flags()[0] is False
        assert flags() == [True, before[1], False, before[3]]
        with pytest.raises(RuntimeError, match="boom"), without_cudnn_attention("cuda"):
            raise RuntimeError("boom")
        assert flags()[0] is True
    finally:
        torch.backends.cuda.enable_mem_efficient_sdp(before[2])
    assert flags() == before


def test_cpu_changes_nothing_and_a_user_who_turned_cudnn_off_keeps_it_off():
    before = flags()
    with without_cudnn_attention("cpu"):
        assert flags() == before
    torch.backends.cuda.enable_cudnn_sdp(False)   # a user who turned it off keeps it off
    try:
        with without_cudnn_attention("cuda"):
            assert flags()[0] is False
        assert flags()[0] is False
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before[0])
