"""The Snake kernels' launch policy and the pending biases of a fused decoder chain (CPU).

``snake.tile_for`` and ``snake_math.sine_for`` are pure choices the Snake launcher makes per call; ``pending.BiasSum``
sums the biases a chain leaves pending (``pending.run_chain``: a residual unit's 1x1 bias is not added to the
stream, the next kernel that reads it adds the sum) and must never serve a stale sum. The chain itself streams
the goldens in ``test_fused_paths_cpu.py``; the kernels are compared with their torch expressions in ``test_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch

from code2wav.sidecar.kernels import pending, snake, snake_math


@pytest.mark.parametrize("num_channels", [1, 2, 3, 5, 40, 64, 96, 192, 1536])
def test_a_tile_holds_the_fixed_element_count_and_every_channel_up_to_its_width(num_channels):
    block_c, block_t = snake.tile_for(num_channels)
    assert block_c * block_t == snake.TILE_ELEMENTS
    assert block_c & (block_c - 1) == 0 and block_t & (block_t - 1) == 0  # powers of two (Triton's aranges)
    assert block_c == min(64, 1 << (num_channels - 1).bit_length())  # all channels where they fit 64


def test_the_sine_is_the_accurate_one_off_cuda_and_for_float32():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert snake_math.sine_for(torch.zeros(2, dtype=dtype)) == snake_math.SINE == 1  # CPU: Triton's interpreter


def test_bias_sum_adds_in_float32_once_and_caches_while_its_parts_are_unchanged():
    gen = torch.Generator().manual_seed(0)
    parts = tuple(torch.nn.Parameter(torch.randn(8, generator=gen).to(torch.bfloat16), requires_grad=False)
                  for _ in range(3))
    total = pending.BiasSum()
    first = total(parts)
    expected = (parts[0].float() + parts[1].float() + parts[2].float()).to(torch.bfloat16)
    assert first.dtype == torch.bfloat16 and torch.equal(first, expected)
    assert total(parts) is first  # cached: a step after the first adds no op
    with torch.no_grad():
        parts[1].add_(1.0)  # as load_state_dict would: an in-place write bumps the version
    second = total(parts)
    assert second is not first
    assert torch.equal(second, (parts[0].float() + parts[1].float() + parts[2].float()).to(torch.bfloat16))
    other = tuple(p.clone() for p in parts)  # the same values in other tensors: not the cached parts
    assert total(other) is not second and torch.equal(total(other), second)


def test_bias_sum_of_one_part_is_that_part_and_of_none_is_none():
    bias = torch.randn(4)
    total = pending.BiasSum()
    assert total((bias,)) is bias
    assert total(()) is None


def test_run_chain_threads_the_pending_biases_through_its_layers():
    calls = []

    def layer(name):
        def run(x, lengths, ctx, carried):
            calls.append((name, carried))
            return x + 1, lengths, (*carried, name)
        return run

    x, lengths, left = pending.run_chain([layer("a"), layer("b")], torch.zeros(1), torch.ones(1), None, ("first",))
    assert calls == [("a", ("first",)), ("b", ("first", "a"))]
    assert left == ("first", "a", "b") and x.item() == 2.0


def test_voxcpm2_scale_bias_folds_pending_biases_into_its_table_once():
    """``(x + p) * s + b == x * s + (p * s + b)`` per bucket: a VoxCPM2 block's pending biases enter the next
    ``ScaleBias``'s table, made once per set of parameters (kept between steps, as ``BiasSum``)."""
    from code2wav.sidecar.models.voxcpm2_audiovae.blocks import ScaleBias

    torch.manual_seed(0)
    cond = ScaleBias(num_buckets=3, channels=5)
    torch.nn.init.normal_(cond.scale_embed.weight)
    torch.nn.init.normal_(cond.bias_embed.weight)
    x = torch.randn(2, 5, 7)  # [B, C, T]
    buckets = torch.tensor([2, 0])
    pending = (torch.randn(5), torch.randn(5), torch.randn(5))
    with torch.inference_mode():
        expected = cond(x + sum(pending)[None, :, None], buckets)  # [B, C, T]
        got = cond(x, buckets, pending)
        table = cond._tables._value
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(cond(x, buckets, pending), got) and cond._tables._value is table  # not made again
        assert not torch.equal(cond(x, buckets), got)  # without them: another table
    with pytest.raises(ValueError, match="kernel forms"):
        cond(x, buckets, pending)  # autograd on: the plain form has no table to fold into


@pytest.mark.parametrize("num_state_cols, piece", [(0, 1), (1, 1), (2, 2), (6, 8), (8, 8), (18, 8), (54, 8)])
def test_the_state_program_takes_at_most_state_cols_columns_a_piece(num_state_cols, piece):
    assert snake.state_cols_for(num_state_cols) == piece
    assert piece <= snake.STATE_COLS
