"""VoxCPM2 AudioVAE decoder against the upstream golden (tests/data/golden/voxcpm2_tiny_a): one-shot, sample-rate
conditioning, exact streaming in any chunking, per-row lengths in one batch, batch-company independence, bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from chunking import clip_sizes
from code2wav.sidecar.models.voxcpm2_audiovae import SHIPPED, AudioVAEConfig, VoxCPM2AudioVAEDecoder, load_folder
from code2wav.sidecar.state_store import POSITION_NBYTES, slot_nbytes

GOLDEN = Path(__file__).parent / "data" / "golden" / "voxcpm2_tiny_a"
TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> VoxCPM2AudioVAEDecoder:
    module, sample_rate_hz = load_folder(GOLDEN)
    assert sample_rate_hz == 48000
    return module


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / "cases.safetensors"))


def stream(model: VoxCPM2AudioVAEDecoder, latents: torch.Tensor, chunks: list[int],
           sr_bucket: torch.Tensor | None = None) -> torch.Tensor:
    """Decode ``latents`` ``[B, D, T]`` chunk by chunk, carrying the state; ``[B, 1, T * U]``."""
    state = model.zero_state(latents.shape[0])
    outs, start = [], 0
    for n in chunks:
        wav, state = model.forward_stream(latents[:, :, start:start + n], None, state, None, sr_bucket)  # [B, n*U]
        outs.append(wav)
        start += n
    assert start == latents.shape[2]
    return torch.cat(outs, dim=1)[:, None]


@torch.no_grad()
def test_one_shot_matches_golden(model, cases):
    full = model(cases["latents"])  # [2, 1, 57 * 240]
    assert full.shape == cases["full"].shape == (2, 1, 57 * 240)
    assert (full - cases["full"]).abs().max().item() <= TOL


@torch.no_grad()
def test_sr_cond_matches_golden(model, cases):
    buckets = model.sr_bucket(cases["sr_cond"], batch=2)
    assert buckets.tolist() == [0, 2]
    out = model(cases["latents"], buckets)
    assert (out - cases["full_sr_cond"]).abs().max().item() <= TOL
    # Default and explicit 48000 Hz are the same bucket (3), and bucket 3 differs from buckets 0/2.
    assert torch.equal(model(cases["latents"], model.sr_bucket(48000, batch=2)), model(cases["latents"]))
    assert (out - cases["full"]).abs().max().item() > 1e-2


def test_sr_bucket_boundaries(model):
    rates = [16000, 20000, 20001, 22050, 24000, 30000, 32000, 40000, 44100, 48000]
    assert model.sr_bucket(torch.tensor(rates), batch=len(rates)).tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 3, 3]
    assert [model.cfg.sr_bucket(r) for r in rates] == [0, 0, 1, 1, 1, 1, 2, 2, 3, 3]
    assert model.cfg.default_sr_bucket == 3
    with pytest.raises(ValueError, match="integer rates in Hz"):
        model.sr_bucket(torch.tensor([48000.0]))
    with pytest.raises(ValueError, match="expected 2 or 1"):
        model.sr_bucket(torch.tensor([16000, 24000, 48000]), batch=2)


@torch.no_grad()
def test_streaming_golden_chunks(model, cases):
    streamed = stream(model, cases["latents"], [1, 16, 40])
    assert (streamed - cases["full"]).abs().max().item() <= TOL
    assert (streamed - cases["streamed"]).abs().max().item() <= TOL  # upstream's streaming_decode


@torch.no_grad()
def test_streaming_with_sr_cond(model, cases):
    buckets = model.sr_bucket(cases["sr_cond"], batch=2)
    streamed = stream(model, cases["latents"], [3, 20, 34], buckets)
    assert (streamed - cases["full_sr_cond"]).abs().max().item() <= TOL


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 57), min_size=1, max_size=20))
def test_streaming_any_chunking(model, cases, sizes):
    with torch.no_grad():
        streamed = stream(model, cases["latents"], clip_sizes(sizes, 57))
    assert (streamed - cases["full"]).abs().max().item() <= TOL


@torch.no_grad()
def test_empty_chunk_is_a_no_op(model, cases):
    state = model.zero_state(2)
    _, state = model.forward_stream(cases["latents"][:, :, :5], None, state)
    wav, after = model.forward_stream(cases["latents"][:, :, 5:5], None, state)
    assert wav.shape == (2, 0)
    assert all(torch.equal(after[k], state[k]) for k in state)


@torch.no_grad()
def test_rows_with_different_lengths_in_one_batch(model, cases):
    """Right-padded rows (``num_frames`` per row) keep exact streams: padding never reaches a row's state."""
    latents, full = cases["latents"], cases["full"][:, 0]  # [2, D, 57], [2, 57 * U]
    spf = model.samples_per_frame
    plans = [[7, 1, 30, 19], [2, 25, 25, 5]]
    state = model.zero_state(2)
    starts, outs = [0, 0], [[], []]
    for step in range(4):
        sizes = [plans[0][step], plans[1][step]]
        width = max(sizes)
        batch = torch.zeros(2, latents.shape[1], width)  # [2, D, width], right-padded with zeros
        for b in range(2):
            batch[b, :, :sizes[b]] = latents[b, :, starts[b]:starts[b] + sizes[b]]
            batch[b, :, sizes[b]:] = 7.0  # loud padding: it must not leak into the state
        wav, state = model.forward_stream(batch, torch.tensor(sizes), state)  # [2, width * U]
        for b in range(2):
            outs[b].append(wav[b, :sizes[b] * spf])
            starts[b] += sizes[b]
    for b in range(2):
        assert (torch.cat(outs[b]) - full[b]).abs().max().item() <= TOL


@torch.no_grad()
def test_batch_company_does_not_change_a_row(model, cases):
    """A row decoded alone, or beside other streams with other states and sample rates, gives the same audio."""
    latents = cases["latents"]
    alone = stream(model, latents[:1], [10, 47])
    gen = torch.Generator().manual_seed(3)
    company = torch.randn(3, latents.shape[1], 57, generator=gen) * 3.0  # [3, D, 57]
    mixed = torch.cat([company[:1], latents[:1], company[1:]], dim=0)  # [4, D, 57]
    state = model.zero_state(4)
    state = {k: torch.randn(v.shape, generator=gen) for k, v in state.items()}
    for k in state:
        state[k][1] = 0.0  # row 1 starts a fresh stream; the others are mid-stream
    buckets = torch.tensor([0, model.cfg.default_sr_bucket, 1, 2])
    outs = []
    for a, n in ((0, 10), (10, 47)):
        wav, state = model.forward_stream(mixed[:, :, a:a + n], None, state, None, buckets)
        outs.append(wav[1])
    assert (torch.cat(outs) - alone[0, 0]).abs().max().item() <= TOL


def test_state_layout_tiny(model):
    layout = model.state_layout()
    assert slot_nbytes(layout, torch.float32) == 4 * 4920 + POSITION_NBYTES  # 4,800 conv tails + 120 frames (cases.json)
    assert layout["model.0"] == (16, 6)
    assert layout["model.2.block.1"] == (64, 1)
    assert layout["model.2.block.4.block.1"] == (32, 54)
    assert model.cfg.history_frames == 24  # ceil(23.81) for rates [6, 5, 4, 2]


def test_state_layout_shipped():
    with torch.device("meta"):
        shipped = VoxCPM2AudioVAEDecoder(SHIPPED)
    layout = shipped.state_layout()
    assert len(layout) == 26
    assert slot_nbytes(layout, torch.float32) == 647_424 + POSITION_NBYTES  # 161,856 floats of state
    assert slot_nbytes(layout, torch.bfloat16) == 323_712 + POSITION_NBYTES
    assert sum(p.numel() for p in shipped.parameters()) == 45_760_641
    assert SHIPPED.samples_per_frame == 1920 and SHIPPED.frame_rate_hz == 25.0
    assert SHIPPED.history_frames == 20
    # 191 file tensors minus one per weight-norm pair (3 + 7n = 45 convs) after folding
    assert len(shipped.decoder.state_dict()) == 191 - 45


@torch.no_grad()
def test_bf16_runs_and_reports_snr(model, cases):
    bf16 = VoxCPM2AudioVAEDecoder(model.cfg)
    bf16.load_state_dict(model.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    assert bf16.decoder.sr_bin_boundaries.dtype == torch.int32  # never cast: 20000 would become 19968
    ref = cases["full"]
    out = bf16(cases["latents"])  # float32 [2, 1, T * U]
    assert out.dtype == torch.float32 and out.shape == ref.shape
    snr_db = 10 * torch.log10(ref.pow(2).mean() / (out - ref).pow(2).mean()).item()
    streamed = stream(bf16, cases["latents"], [1, 16, 40])
    snr_stream_db = 10 * torch.log10(ref.pow(2).mean() / (streamed - ref).pow(2).mean()).item()
    print(f"\nvoxcpm2 tiny bf16 vs fp32 golden: one-shot SNR {snr_db:.1f} dB, streamed (1/16/40) {snr_stream_db:.1f} dB")
    assert snr_db > 15.0 and snr_stream_db > 15.0
    assert bf16.zero_state(1)["model.0"].dtype == torch.bfloat16


def test_config_refuses_other_variants():
    for bad, hint in (({"depthwise": False}, "depthwise"), ({"use_noise_block": True}, "use_noise_block"),
                      ({"cond_type": "concat"}, "cond_type"), ({"cond_out_layer": True}, "cond_out_layer"),
                      ({"sr_bin_boundaries": None}, "sr_bin_boundaries"), ({"decoder_dim": 100}, "halve"),
                      ({"decoder_rate": [2]}, "decoder_rate")):
        with pytest.raises(ValueError, match=hint):
            AudioVAEConfig.model_validate(bad)
    assert AudioVAEConfig.model_validate({"latent_dim": None}).latent_channels == 128 * 2 ** 4


@torch.no_grad()
def test_finite_history_window_equals_exact(model, cases):
    """Frame t depends on frames t - ceil(H) .. t only: a stateless window with ceil(H) context frames is exact."""
    latents, full = cases["latents"], cases["full"]
    spf, context = model.samples_per_frame, model.cfg.history_frames
    start = 40
    window = model(latents[:, :, start - context:])  # [2, 1, (57 - start + context) * U]
    assert (window[:, :, context * spf:] - full[:, :, start * spf:]).abs().max().item() <= TOL
    short = model(latents[:, :, start - context + 4:])  # 4 frames too little context: not exact any more
    assert (short[:, :, (context - 4) * spf:] - full[:, :, start * spf:]).abs().max().item() > TOL


@torch.no_grad()
def test_row_without_new_frames_keeps_its_state(model, cases):
    """``num_frames`` 0 for a row (the engine's slicing can give it) leaves that row's state as it was."""
    state = model.zero_state(2)
    _, state = model.forward_stream(cases["latents"][:, :, :9], None, state)
    _, after = model.forward_stream(cases["latents"][:, :, 9:13], torch.tensor([4, 0]), state)
    assert all(torch.equal(after[k][1], state[k][1]) for k in state)
    assert not torch.equal(after["model.0"][0], state["model.0"][0])


@pytest.mark.cuda
def test_cuda_eager_and_graph_match_cpu_golden(cases):
    """GPU fp32 (TF32 off): eager streaming within 1e-5 of the golden, and a captured CUDA graph of
    ``forward_stream`` (static latents, lengths, state, buckets) equal to eager within 1e-5."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    module, _ = load_folder(GOLDEN)
    module = module.cuda()
    latents = cases["latents"].cuda()  # [2, D, 57]
    with torch.no_grad():
        eager = stream(module, latents, [1, 16, 40]).cpu()
        assert (eager - cases["full"]).abs().max().item() <= TOL
        n = 8
        static_x = torch.zeros(2, latents.shape[1], n, device="cuda")
        static_len = torch.full((2,), n, dtype=torch.long, device="cuda")
        static_bucket = torch.full((2,), module.cfg.default_sr_bucket, dtype=torch.long, device="cuda")
        static_state = module.zero_state(2)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside capture
                module.forward_stream(static_x, static_len, static_state, None, static_bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_wav, static_new = module.forward_stream(static_x, static_len, static_state, None, static_bucket)
        pieces = []
        for k in range(0, 56, n):  # 7 chunks of 8 frames through the graph, state carried by copy
            static_x.copy_(latents[:, :, k:k + n])
            graph.replay()
            pieces.append(static_wav.clone())
            for name in static_state:
                static_state[name].copy_(static_new[name])
        graphed = torch.cat(pieces, dim=1)[:, None].cpu()  # [2, 1, 56 * U]
    spf = module.samples_per_frame
    assert (graphed - eager[:, :, :56 * spf]).abs().max().item() <= TOL


@pytest.mark.parametrize("dilation", [1, 3, 9])
def test_depthwise_taps_equal_the_depthwise_conv(dilation):
    """The formulation a depthwise conv takes under ``torch.compile`` (``depthwise.shifted_taps``, which Inductor
    fuses) is the same convolution (float64, so only the summation order differs)."""
    from code2wav.sidecar.kernels.depthwise import shifted_taps

    gen = torch.Generator().manual_seed(dilation)
    x = torch.randn(3, 8, 6 * dilation + 11, generator=gen, dtype=torch.float64)  # [B, C, P + T]
    weight = torch.randn(8, 1, 7, generator=gen, dtype=torch.float64)
    bias = torch.randn(8, generator=gen, dtype=torch.float64)
    expected = torch.nn.functional.conv1d(x, weight, bias, dilation=dilation, groups=8)  # [B, C, T]
    got = shifted_taps(x, weight, bias, dilation)
    assert got.shape == expected.shape == (3, 8, 11)
    assert (got - expected).abs().max().item() < 1e-12
