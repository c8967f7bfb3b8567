"""bench_decode_kernels: its FLOP count against PyTorch's own counter, and its row-count check against a
plain loop that recomputes each prefix of the batch."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_decode_kernels import HIDDEN, LAYER_LINEARS, MLP, layer_flops, rows_that_differ  # noqa: E402


@pytest.mark.parametrize("rows", [1, 7])
def test_layer_flops_match_the_flop_counter(rows):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        for i, o in LAYER_LINEARS:
            F.linear(torch.randn(rows, i), torch.randn(o, i))
    assert layer_flops(rows) == counter.get_total_flops()
    # by hand: q and o 576x576, k and v 576x192, gate and up 576x1536, down 1536x576
    assert layer_flops(1) == 2 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)


def test_row_count_check_agrees_with_a_plain_loop():
    """The same seed, weights and inputs as the benchmark; the reference recomputes every prefix."""
    candidates = [1, 3, 8, 12, 32]
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        w = torch.randn(MLP, HIDDEN, generator=g).to(dtype)
        x = torch.randn(40, HIDDEN, generator=g).to(dtype)
        full = F.linear(x, w)
        want = []
        for m in candidates:
            alone = F.linear(x[:m], w)
            if (alone != full[:m]).any():
                want.append(m)
        assert rows_that_differ(dtype, 40, candidates) == want
