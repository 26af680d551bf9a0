"""The streaming kit (``sidecar/models/streaming``): its blocks against plain torch definitions, and the same
exactness tests for the three families built from it (Qwen3-TTS's tiny golden, VoxCPM2's tiny golden, the toy of
``test_family_toy.py``).

Blocks (float64, CPU): a causal conv with a zero state is ``F.conv1d`` over the input left-padded with ``(k - 1) d``
zeros, a causal transposed conv is ``F.conv_transpose1d`` cut to ``T s`` samples; fed in uneven chunks with the
state carried, either equals itself fed whole; right padding reaches neither a row's output nor its state.

Families (float32, through ``LoadedModel.forward_stream``): streamed in random uneven chunkings, rows batched with
right padding, the audio equals the one-shot reference within the family's tolerance (1e-5 for all three: the
goldens' ``full``, the toy's numpy reference); right-padded rows and a row's batch company change neither its audio
nor its state; the state layout from the kit's one function (``assign_state_keys``) is what the contract declares
and what the stream carries, every entry of it live.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import Tensor, nn

from chunking import splits_of
from code2wav.sidecar.models import LoadedModel, StreamBatch, load_model
from code2wav.sidecar.models.streaming import (CausalConv, CausalTransConv, StatefulBlock, StreamActivation,
                                               StreamContext, StreamSequential, assign_state_keys, flat_conv_names,
                                               zero_state)
from conftest import TINY, VOXCPM2_TINY
from test_family_toy import LATENT_DIM, TOY, reference

EXACT = 1e-12  # float64 blocks: the same sums in another order
TOL = 1e-5  # every family's existing tolerance against its one-shot reference (float32)
STATE_TOL = 1e-4
"""A state entry's tolerance, relative to its largest value: entries are the decoders' inner activations (up to ~14
in the goldens), and a row batched or alone is rounded differently by GEMMs of other shapes (float32: up to 1.04e-5
of the scale measured on the Qwen3 golden's last conv input, whose audio stays within 5e-6). A leak of padding or of
another row's state moves an entry by its own order of magnitude."""


class Tanh(StreamActivation):
    """A plain activation (no kernel form): the kit calls its ``forward``."""

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext) -> tuple[Tensor, Tensor]:
        return torch.tanh(x), lengths


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return module.double()


def _run(block: nn.Module, x: Tensor, lengths: Tensor, state: dict[str, Tensor],
         act: StreamActivation | None) -> tuple[Tensor, dict[str, Tensor]]:
    ctx = StreamContext(state)
    y, _ = block(x, lengths, ctx, act=act)
    return y, ctx.state_out


def _chunked(block: nn.Module, layout: dict, x: Tensor, chunks: list[int],
             act: StreamActivation | None) -> tuple[Tensor, dict[str, Tensor]]:
    """``x`` ``[B, C, T]`` fed in ``chunks``, the state carried: ``(outputs joined, last state)``."""
    state = zero_state(layout, x.shape[0], x.dtype, x.device)
    outs, start = [], 0
    for n in chunks:
        y, state = _run(block, x[:, :, start:start + n], torch.full((x.shape[0],), n), state, act)
        outs.append(y)
        start += n
    return torch.cat(outs, dim=2), state


CONVS = [  # (C_in, C_out, kernel, dilation, groups)
    (4, 6, 3, 1, 1),  # dense (a ConvChoice: cuDNN on the CPU)
    (4, 4, 7, 3, 1),  # dilated
    (4, 6, 3, 1, 2),  # grouped
    (5, 5, 7, 3, 5),  # depthwise
    (4, 1, 7, 1, 1),  # the one-output last layer
    (4, 6, 1, 1, 1),  # k1: no state
]
TRANS_CONVS = [(4, 2), (6, 3), (3, 3), (5, 2), (3, 2)]  # (kernel, stride): 2s (add form), s (frames), general


@pytest.mark.parametrize("c_in, c_out, kernel, dilation, groups", CONVS)
@pytest.mark.parametrize("with_act", [False, True])
def test_a_causal_conv_with_a_zero_state_is_conv1d_over_left_zero_padding_and_chunks_equal_whole(
        c_in, c_out, kernel, dilation, groups, with_act):
    conv = _seeded(CausalConv(c_in, c_out, kernel, dilation, groups), kernel * 10 + dilation)
    holder = nn.ModuleDict({"conv": conv})
    layout = assign_state_keys(holder)
    num_cols = (kernel - 1) * dilation
    assert layout == ({"conv": (c_in, num_cols)} if num_cols else {})
    act = Tanh() if with_act else None
    x = torch.randn(2, c_in, 23, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # [B, C, T]
    h = torch.tanh(x) if with_act else x
    expected = F.conv1d(F.pad(h, (num_cols, 0)), conv.conv.weight, conv.conv.bias, dilation=dilation,
                        groups=groups)  # [B, C_out, T]
    for chunks in ([23], [1, 4, 2, 9, 7], [5, 1, 1, 16]):
        y, state = _chunked(conv, layout, x, chunks, act)
        assert y.shape == expected.shape and (y - expected).abs().max().item() < EXACT, chunks
        if num_cols:  # the last (k - 1) d inputs, activated as the conv read them
            assert (state["conv"] - h[:, :, -num_cols:]).abs().max().item() == 0.0


@pytest.mark.parametrize("kernel, stride", TRANS_CONVS)
@pytest.mark.parametrize("with_act", [False, True])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])  # no grad: the kernel-s F.linear form
def test_a_causal_trans_conv_with_a_zero_state_is_conv_transpose1d_cut_and_chunks_equal_whole(
        kernel, stride, with_act, grad):
    conv = _seeded(CausalTransConv(4, 3, kernel, stride), kernel * 10 + stride)
    holder = nn.ModuleDict({"up": conv})
    layout = assign_state_keys(holder)
    num_prev = -(-kernel // stride) - 1
    assert layout == ({"up": (4, num_prev)} if num_prev else {})
    act = Tanh() if with_act else None
    num_frames = 11
    x = torch.randn(2, 4, num_frames, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    h = torch.tanh(x) if with_act else x
    expected = F.conv_transpose1d(h, conv.conv.weight, conv.conv.bias, stride=stride)[:, :, :num_frames * stride]
    with torch.set_grad_enabled(grad):
        for chunks in ([num_frames], [1, 3, 1, 6], [4, 7]):
            y, state = _chunked(conv, layout, x, chunks, act)
            assert y.shape == expected.shape and (y - expected).abs().max().item() < EXACT, chunks
            if num_prev:
                assert (state["up"] - h[:, :, -num_prev:]).abs().max().item() == 0.0


@pytest.mark.parametrize("block", ["conv", "trans_conv"])
def test_right_padding_reaches_neither_a_rows_output_nor_its_state(block):
    """Row 1 is 3 columns short of the batch (its padding loud); its output and state equal the row run alone."""
    module = CausalConv(4, 4, 7, dilation=3) if block == "conv" else CausalTransConv(4, 3, 4, 2)
    holder = nn.ModuleDict({"b": _seeded(module, 3)})
    layout = assign_state_keys(holder)
    gen = torch.Generator().manual_seed(4)
    state = {k: torch.randn((2, *shape), generator=gen, dtype=torch.float64) for k, shape in layout.items()}
    x = torch.randn(2, 4, 9, generator=gen, dtype=torch.float64)
    x[1, :, 6:] = 1e3
    scale = 1 if block == "conv" else 2
    y, out = _run(module, x, torch.tensor([9, 6]), state, Tanh())
    alone, alone_out = _run(module, x[1:, :, :6], torch.tensor([6]), {k: v[1:] for k, v in state.items()}, Tanh())
    assert (y[1:, :, :6 * scale] - alone).abs().max().item() < EXACT
    assert all((out[k][1:] - alone_out[k]).abs().max().item() == 0.0 for k in layout)


def test_the_sequential_container_threads_lengths_and_the_layout_walk_names_blocks_by_path():
    net = StreamSequential([CausalConv(4, 4, 3), StreamSequential([CausalTransConv(4, 2, 6, 3), CausalConv(2, 2, 1)])])
    layout = assign_state_keys(net)
    assert layout == {"0": (4, 2), "1.0": (2 * 2, 1)}
    assert [m.state_key for m in net.modules() if isinstance(m, StatefulBlock)] == ["0", "1.0", ""]  # k1: no key
    state = zero_state(layout, 3, torch.float32, torch.device("cpu"))
    assert {k: (tuple(v.shape), v.dtype) for k, v in state.items()} == {"0": ((3, 4, 2), torch.float32),
                                                                       "1.0": ((3, 4, 1), torch.float32)}
    ctx = StreamContext(state)
    y, lengths = net(torch.randn(3, 4, 5), torch.tensor([5, 4, 1]), ctx)
    assert y.shape == (3, 2, 15) and lengths.tolist() == [15, 12, 3] and set(ctx.state_out) == set(layout)


def test_flat_conv_names_map_the_kit_layout_to_a_checkpoint_one_level_up():
    net = nn.ModuleDict({"model": StreamSequential([CausalConv(2, 2, 3), Tanh(), CausalTransConv(2, 1, 2, 1)])})
    assert flat_conv_names(net) == {"model.0.conv.weight": "model.0.weight", "model.0.conv.bias": "model.0.bias",
                                    "model.2.conv.weight": "model.2.weight", "model.2.conv.bias": "model.2.bias"}
    assert set(flat_conv_names(net)) == set(net.state_dict())


def test_the_fused_only_arguments_are_refused_without_the_fused_kernel():
    conv = CausalConv(4, 4, 7, groups=4)
    layout = assign_state_keys(nn.ModuleDict({"c": conv}))
    state = zero_state(layout, 1, torch.float32, torch.device("cpu"))
    x, lengths = torch.randn(1, 4, 3), torch.tensor([3])
    with pytest.raises(ValueError, match="in_bias needs the fused kernel"):
        conv(x, lengths, StreamContext(state), act=Tanh(), in_bias=torch.zeros(4))
    with pytest.raises(ValueError, match="bias_later needs a conv with a ConvChoice"):
        conv(x, lengths, StreamContext(state), bias_later=True)


# ------------------------------------------------------------------------------------------- the three families


def _toy() -> tuple[LoadedModel, Tensor, Tensor]:
    module, contract = TOY.default(seed=3)
    module = module.requires_grad_(False)
    model = LoadedModel("toy", TOY, module, contract, torch.device("cpu"), torch.float32, "random-weights")
    latents = torch.randn(2, LATENT_DIM, 30, generator=torch.Generator().manual_seed(5))  # [2, D, T]
    weights = module.state_dict()
    full = torch.stack([torch.from_numpy(reference(weights, latents[b].numpy())) for b in range(2)])  # numpy
    return model, latents, full


def _golden(folder) -> tuple[LoadedModel, Tensor, Tensor]:
    model = load_model(str(folder), torch.device("cpu"), "float32")
    cases = load_file(str(folder / "cases.safetensors"))
    inputs = cases["codes"] if "codes" in cases else cases["latents"]
    return model, inputs, cases["full"][:, 0]


FAMILIES = {"qwen3_tts": lambda: _golden(TINY), "voxcpm2_audiovae": lambda: _golden(VOXCPM2_TINY), "toy": _toy}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """``(model, inputs [2, C, T], one-shot audio [2, T * U])``."""
    return FAMILIES[request.param]()


def _padding(model: LoadedModel, shape: tuple[int, ...], seed: int) -> Tensor:
    """Inputs that must never be heard: random codes, or loud latents."""
    if model.input.is_integer:
        return torch.randint(0, model.input.high, shape, generator=torch.Generator().manual_seed(seed))
    return torch.full(shape, 7.0)


def _step(model: LoadedModel, chunks: list[Tensor], positions: list[int], state: dict[str, Tensor],
          pad_to: int = 0, seed: int = 0) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One batched forward of ``chunks`` (``[C, n_b]`` each), right-padded to the longest (or ``pad_to``): each
    row's valid audio and the new state."""
    width = max([c.shape[1] for c in chunks] + [pad_to])
    batch = _padding(model, (len(chunks), chunks[0].shape[0], width), seed)  # [B, C, width]
    for b, c in enumerate(chunks):
        batch[b, :, :c.shape[1]] = c
    num_frames = torch.tensor([c.shape[1] for c in chunks])
    with torch.inference_mode():
        wav, new_state = model.forward_stream(
            StreamBatch(batch, num_frames, torch.tensor(positions), model.zero_options(len(chunks))), state)
    spf = model.samples_per_frame
    return [wav[b, :c.shape[1] * spf] for b, c in enumerate(chunks)], new_state


def _same_state(got: dict[str, Tensor], expected: dict[str, Tensor], row: int) -> bool:
    """Row ``row`` of ``got`` against ``expected``'s one row, each entry within ``STATE_TOL`` of its scale."""
    return all((got[k][row] - expected[k][0]).abs().max().item()
               <= STATE_TOL * max(1.0, expected[k][0].abs().max().item()) for k in expected)


def _rows(state: dict[str, Tensor], rows: list[int]) -> dict[str, Tensor]:
    return {k: v[rows] for k, v in state.items()}


def stream_rows(model: LoadedModel, inputs: Tensor, plans: list[list[int]]) -> list[Tensor]:
    """Row ``b`` of ``inputs`` in the chunk sizes ``plans[b]``; every step batches the next chunk of every unfinished
    row (right-padded to the longest), each row with its own state and position."""
    state = model.zero_state(len(plans))
    starts, steps, outs = [0] * len(plans), [0] * len(plans), [[] for _ in plans]
    while any(steps[b] < len(plans[b]) for b in range(len(plans))):
        rows = [b for b in range(len(plans)) if steps[b] < len(plans[b])]
        chunks = [inputs[b, :, starts[b]:starts[b] + plans[b][steps[b]]] for b in rows]
        audio, new_state = _step(model, chunks, [starts[b] for b in rows], _rows(state, rows), seed=sum(steps))
        for i, b in enumerate(rows):
            outs[b].append(audio[i])
            for k in state:
                state[k][b] = new_state[k][i]
            starts[b] += plans[b][steps[b]]
            steps[b] += 1
    return [torch.cat(o) for o in outs]


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_streamed_in_random_uneven_chunkings_equals_one_shot(family, data):
    model, inputs, full = family
    total = inputs.shape[2]
    plans = [data.draw(splits_of(total)), data.draw(splits_of(total))]
    for b, out in enumerate(stream_rows(model, inputs, plans)):
        assert out.shape == full[b].shape
        assert (out - full[b]).abs().max().item() <= TOL, (b, plans[b])


def _mid_stream(model: LoadedModel, inputs: Tensor, first: int) -> dict[str, Tensor]:
    """Both rows' state after their first ``first`` frames."""
    _, state = _step(model, [inputs[0, :, :first], inputs[1, :, :first]], [0, 0], model.zero_state(2))
    return state


def test_right_padded_rows_never_change_a_rows_audio_or_state(family):
    model, inputs, full = family
    first, n = 7, 5
    state = _mid_stream(model, inputs, first)
    chunk = inputs[0, :, first:first + n]
    alone, alone_state = _step(model, [chunk], [first], _rows(state, [0]))
    for pad_to, seed in ((n + 3, 1), (n + 11, 2)):  # padded in a batch with a longer row, or past every row
        other = inputs[1, :, first:first + n + 3]
        audio, new_state = _step(model, [chunk, other], [first, first], state, pad_to=pad_to, seed=seed)
        assert (audio[0] - alone[0]).abs().max().item() <= TOL
        assert _same_state(new_state, alone_state, 0)
    spf = model.samples_per_frame
    assert (alone[0] - full[0, first * spf:(first + n) * spf]).abs().max().item() <= TOL


def test_a_rows_audio_does_not_depend_on_its_batch_company(family):
    model, inputs, _ = family
    first, n = 6, 4
    state = _mid_stream(model, inputs, first)
    chunk = inputs[0, :, first:first + n]
    results = []
    for company, seed in ((inputs[1, :, :n + 2], 3), (inputs[1, :, 9:10], 4), (inputs[0, :, :n], 5)):
        company_state = {k: v[[1]] * (seed - 3) for k, v in state.items()}  # zero, the mid-stream one doubled ...
        joint = {k: torch.cat([state[k][[0]], company_state[k]]) for k in state}
        position = random.Random(seed).randrange(0, 30)
        results.append(_step(model, [chunk, company], [first, position], joint, seed=seed))
    (audio, new_state), others = results[0], results[1:]
    for other_audio, other_state in others:
        assert (other_audio[0] - audio[0]).abs().max().item() <= TOL
        assert _same_state(other_state, {k: v[[0]] for k, v in new_state.items()}, 0)


def _state_root(model: LoadedModel) -> nn.Module:
    """The module whose walk gave the family its layout (the checkpoint's ``decoder`` for both goldens)."""
    return getattr(model.module, "decoder", model.module)


def test_the_kit_layout_is_the_state_the_stream_carries(family):
    model, inputs, _ = family
    root = _state_root(model)
    layout = assign_state_keys(root)  # the one walk, again: the same names
    assert layout == model.state_layout()  # what the contract declares (``family.state_specs`` of the same walk)
    blocks = {name: m for name, m in root.named_modules() if isinstance(m, StatefulBlock) and m.state_shape()}
    assert set(blocks) == set(layout) and all(m.state_key == name for name, m in blocks.items())
    first, n = 8, 3
    state = _mid_stream(model, inputs, first)
    assert {k: (tuple(v.shape[1:]), v.dtype) for k, v in state.items()} == {
        k: (shape, model.dtype) for k, shape in layout.items()}
    chunks = [inputs[0, :, first:first + n], inputs[1, :, first:first + n]]
    positions = [first + 40, first + 40]  # past any attention window: every cached position is seen
    audio, _ = _step(model, chunks, positions, state)
    for key in layout:  # every entry is live: changing it changes the audio
        moved = dict(state, **{key: state[key] + 0.5})
        other, _ = _step(model, chunks, positions, moved)
        assert max((a - o).abs().max().item() for a, o in zip(audio, other)) > 1e-4, key


def test_the_toy_reference_is_independent_of_the_module():
    """The toy's one-shot audio (numpy from its weights) against the family's own one-shot forward."""
    model, latents, full = _toy()
    with torch.inference_mode():
        one_shot = model.forward(latents)[:, 0]  # [2, T * U]
    assert np.abs(one_shot.numpy() - full.numpy()).max() <= TOL
