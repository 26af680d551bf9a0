"""A decoder family defined in this file, built from the streaming kit alone, serves streams end to end through a
real server and the real client.

The toy family: float latents ``[B, D, T]`` -> a kit ``CausalConv`` (kernel 2, dense: ``h_t = A0 x_{t-1} + A1 x_t
+ a``) -> a kit ``CausalTransConv`` (kernel ``2U``, stride ``U``: frame ``t``'s ``U`` samples are ``W0 . h_t + W1 .
h_{t-1} + bias``); its per-stream state is what the kit's ``assign_state_keys`` lays out (each conv's last input
frame), and an integer stream option ``gain`` (1..4) scales the audio per row. Nothing outside this file knows the
family: the server gets it through ``Server(cfg, families=register_family(FAMILIES, TOY))``. The reference audio is
computed from the weights with numpy (the formulas above), not by the module. CPU runs eager; the CUDA test runs
the same streams with graphs captured at start-up and checks that they replayed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from code2wav.client import SidecarClient
from code2wav.client import errors as cerr
from code2wav.sidecar.config import load_config
from code2wav.sidecar.models import (FAMILIES, Contract, FamilyError, GraphBuckets, InputSpec, StreamBatch,
                                     StreamOption, detect_family, load_model, register_family, state_specs)
from code2wav.sidecar.models.streaming import (CausalConv, CausalTransConv, StreamContext, assign_state_keys,
                                               zero_state)
from code2wav.sidecar.server import Server

LATENT_DIM = 6
SAMPLES_PER_FRAME = 8
TOL = 1e-5  # float32, a few dozen multiply-adds per sample


class ToyDecoder(nn.Module):
    def __init__(self, latent_dim: int, samples_per_frame: int) -> None:
        super().__init__()
        self.mix = CausalConv(latent_dim, latent_dim, 2)
        self.up = CausalTransConv(latent_dim, 1, 2 * samples_per_frame, samples_per_frame)
        self.samples_per_frame = samples_per_frame
        self.layout = assign_state_keys(self)  # {"mix": (D, 1), "up": (D, 1)}

    def forward_stream(self, latents: Tensor, num_frames: Tensor, state: dict[str, Tensor]
                       ) -> tuple[Tensor, dict[str, Tensor]]:
        ctx = StreamContext(state)
        h, lengths = self.mix(latents.to(self.up.conv.weight.dtype), num_frames, ctx)  # [B, D, T]
        wav, _ = self.up(h, lengths, ctx)  # [B, 1, T * U]
        return wav[:, 0].float(), ctx.state_out  # [B, T * U]


class ToyFamily:
    name = "toy_latents"
    default_model_name = "toy"
    graph_buckets = GraphBuckets(exact_batch_sizes=(1, 2), exact_frames=(1, 8), window_batch_sizes=(1,),
                                 window_frames=(8,))

    def recognises(self, config: Mapping[str, Any]) -> bool:
        return isinstance(config.get("toy_decoder"), dict)

    def _contract(self, module: ToyDecoder) -> Contract:
        return Contract(input=InputSpec("latents", module.mix.conv.in_channels), sample_rate_hz=16000,
                        samples_per_frame=module.samples_per_frame, state=state_specs(module.layout),
                        stream_options=(StreamOption("gain", 1, 4, 1),))

    def load(self, folder: Path) -> tuple[ToyDecoder, Contract]:
        cfg = json.loads((folder / "config.json").read_text())["toy_decoder"]
        module = ToyDecoder(cfg["latent_dim"], cfg["samples_per_frame"])
        module.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
        return module, self._contract(module)

    def default(self, seed: int) -> tuple[ToyDecoder, Contract]:
        torch.manual_seed(seed)
        module = ToyDecoder(LATENT_DIM, SAMPLES_PER_FRAME)
        return module, self._contract(module)

    def forward_stream(self, module: ToyDecoder, batch: StreamBatch,
                       state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        wav, new_state = module.forward_stream(batch.inputs, batch.num_frames, state)  # [B, T * U]
        return wav * batch.options["gain"][:, None].to(wav.dtype), new_state  # [B, T * U]

    def forward(self, module: ToyDecoder, inputs: Tensor) -> Tensor:
        batch = inputs.shape[0]
        lengths = torch.full((batch,), inputs.shape[2], dtype=torch.long, device=inputs.device)
        weight = module.up.conv.weight
        wav, _ = module.forward_stream(inputs, lengths, zero_state(module.layout, batch, weight.dtype, weight.device))
        return wav[:, None]  # [B, 1, T * U]

    def use_fused_kernels(self, module: ToyDecoder, enabled: bool) -> bool:
        return False  # no hand-written kernels: torch ops everywhere


TOY = ToyFamily()
TEST_FAMILIES = register_family(FAMILIES, TOY)


def reference(weights: dict[str, Tensor], latents: np.ndarray, gain: int = 1) -> np.ndarray:
    """The module docstring's formulas from the weights (numpy, float64): ``[T * U]``."""
    mix_w = weights["mix.conv.weight"].double().numpy()  # [D, D, 2]: tap 0 sees the frame before
    mix_b = weights["mix.conv.bias"].double().numpy()  # [D]
    w = weights["up.conv.weight"].double().numpy()[:, 0, :]  # [D, 2U]
    bias = float(weights["up.conv.bias"].double().numpy()[0])
    spf = w.shape[1] // 2
    x = latents.astype(np.float64)  # [D, T]

    def before(frames: np.ndarray) -> np.ndarray:  # each frame's predecessor, zero before the first
        return np.concatenate([np.zeros((frames.shape[0], 1)), frames[:, :-1]], axis=1)  # [D, T]

    h = mix_w[:, :, 0] @ before(x) + mix_w[:, :, 1] @ x + mix_b[:, None]  # [D, T]
    blocks = h.T @ w[:, :spf] + before(h).T @ w[:, spf:] + bias  # [T, U]
    return (blocks.reshape(-1) * gain).astype(np.float32)  # [T * U]


@pytest.fixture
def toy_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "toy_model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"toy_decoder": {"latent_dim": LATENT_DIM,
                                                                    "samples_per_frame": SAMPLES_PER_FRAME}}))
    torch.manual_seed(7)
    module = ToyDecoder(LATENT_DIM, SAMPLES_PER_FRAME)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


class InProcessServer:
    """A real ``Server`` (sockets, sessions, scheduler, engine) on its own asyncio loop in a thread. ``prepare``: called
    with the server on that loop once it started, before it serves (a test's hook into its parts)."""

    def __init__(self, cfg, families=FAMILIES, prepare: Callable[[Server], None] | None = None) -> None:
        self.server = Server(cfg, families=families)
        self.prepare = prepare
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="toy-server", daemon=True)
        self._thread.start()
        if not self._started.wait(120):
            raise TimeoutError("the in-process server did not start within 120 s")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            try:
                await self.server.start()
            except BaseException as exc:  # reported to the test thread
                self._error = exc
                self._started.set()
                return
            if self.prepare is not None:
                self.prepare(self.server)
            self._started.set()
            await self.server.serve()

        self._loop.run_until_complete(main())

    @property
    def thread_name(self) -> str:
        """The name of the thread the server's loop runs on."""
        return self._thread.name

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self.server.stop)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the in-process server did not stop within 30 s"


def serve(tmp_path: Path, folder: Path, device: str, **extra) -> InProcessServer:
    cfg = load_config(None, {"address": f"ipc://{tmp_path}/toy.sock", "model": str(folder), "device": device,
                             "metrics_port": 0, "streams": {"max_streams": 8}, **extra})
    return InProcessServer(cfg, TEST_FAMILIES)


def test_registry_detects_the_toy_folder_and_refuses_an_unknown_one(toy_folder, tmp_path):
    assert detect_family(toy_folder, TEST_FAMILIES) is TOY
    with pytest.raises(FamilyError, match="is no known decoder family; known: \\['qwen3_tts', 'voxcpm2_audiovae'\\]"):
        detect_family(toy_folder)  # the built-in list does not know it: nothing was registered globally
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"something": 1}))
    with pytest.raises(FamilyError, match="no known decoder family"):
        load_model(str(other), torch.device("cpu"), families=TEST_FAMILIES)
    with pytest.raises(ValueError, match="already registered"):
        register_family(TEST_FAMILIES, TOY)
    model = load_model(str(toy_folder), torch.device("cpu"), families=TEST_FAMILIES)
    assert (model.name, model.family_name, model.input.kind, model.num_channels) == ("toy", "toy_latents",
                                                                                      "latents", LATENT_DIM)
    assert model.state_layout() == {"mix": (LATENT_DIM, 1), "up": (LATENT_DIM, 1)}  # each conv's last input frame


def _stream_and_check(client: SidecarClient, weights: dict[str, Tensor], chunks: list[int], gain: int,
                      stream_id: str) -> None:
    gen = torch.Generator().manual_seed(len(stream_id) + gain)
    latents = torch.randn(LATENT_DIM, sum(chunks), generator=gen)  # [D, T]
    stream = client.open_stream(stream_id, options={"gain": gain} if gain != 1 else None)
    outs, start = [], 0
    for i, n in enumerate(chunks):
        outs.append(stream.decode(latents[:, start: start + n], final=i == len(chunks) - 1))
        start += n
    audio = torch.cat(outs).numpy()
    expected = reference(weights, latents.numpy(), gain)
    assert audio.shape == expected.shape
    assert np.abs(audio - expected).max() <= TOL


def _serve_streams(tmp_path: Path, toy_folder: Path, device: str, **extra) -> Server:
    weights = load_file(str(toy_folder / "model.safetensors"))
    running = serve(tmp_path, toy_folder, device, **extra)
    try:
        with SidecarClient(running.server.address, timeout_s=30) as client:
            info = client.models[0]
            assert (info.family, info.input_kind, info.input_dtypes, info.channels, info.valid_range) == (
                "toy_latents", "latents", ("float32", "bfloat16"), LATENT_DIM, None)
            assert (info.sample_rate, info.samples_per_frame) == (16000, SAMPLES_PER_FRAME)
            assert [(o.name, o.low, o.high, o.default) for o in info.stream_options] == [("gain", 1, 4, 1)]
            _stream_and_check(client, weights, [1, 5, 3, 7], gain=1, stream_id="a")
            _stream_and_check(client, weights, [4, 4, 1], gain=3, stream_id="bb")
            with pytest.raises(cerr.InvalidArgument, match=r"'gain' must be an integer in \[1, 4\], got 9"):
                client.open_stream("bad-option", options={"gain": 9})
            with pytest.raises(cerr.InvalidArgument, match="unknown stream option"):
                client.open_stream("bad-name", options={"sr_cond": 1})
            bad = client.open_stream("nan")
            with pytest.raises(cerr.InvalidArgument, match="non-finite"):
                bad.decode(torch.full((LATENT_DIM, 2), float("nan")))
            with pytest.raises(cerr.InvalidArgument, match="latents must be a float"):
                bad.decode(np.zeros((LATENT_DIM, 2), dtype=np.int64))
        return running.server
    finally:
        running.stop()


def test_toy_family_serves_exact_streams_end_to_end_on_cpu(toy_folder, tmp_path):
    _serve_streams(tmp_path, toy_folder, "cpu")


@pytest.mark.cuda
def test_toy_family_serves_exact_streams_with_cuda_graphs(toy_folder, tmp_path):
    server = _serve_streams(tmp_path, toy_folder, "cuda")  # the family's own buckets: b1, b2 x 1, 8 frames
    summary = server.engine.graphs.summary()
    assert all(s["status"] == "captured" for s in summary), summary
    replays = server.metrics.graph_replays.labels(component="exact", bucket="b1xt8")._value.get()
    assert replays >= 4, summary  # the 5-, 3-, 7-, 4- and 4-frame chunks replay b1 x t8
