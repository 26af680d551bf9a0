"""Float latents and per-stream options on the wire: proto parsing (inline and CUDA IPC descriptors, open_stream
options), the client's input conversion, and the sidecar's checks of latents against a model's contract."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from code2wav import proto
from code2wav.client.errors import InvalidArgument
from code2wav.client.transport import InlineTransport, as_wire_inputs, cuda_wire_inputs
from code2wav.proto import (Chunk, CudaIpcLoc, Decode, ErrorCode, InlineLoc, OpenStream, ProtocolError, TensorDesc,
                            decode_client_message, encode)
from code2wav.sidecar.latent_inputs import check_finite, inline_latents, sr_cond_hz, stream_options
from code2wav.sidecar.work import ChunkRejected

D = 64


def _latents(num_frames: int = 5) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((D, num_frames)).astype(np.float32)  # [D, n]


def test_open_stream_options_round_trip():
    msg = OpenStream(7, "s1", None, "exact", 0, {"sr_cond": 16000})
    parsed = decode_client_message(encode(msg))
    assert parsed == msg and parsed.options == {"sr_cond": 16000}
    plain = OpenStream(8, "s2")
    assert "options" not in plain.to_wire()  # servers without options support still accept it
    assert decode_client_message(encode(plain)).options == {}


@pytest.mark.parametrize(("options", "fragment"), [
    ({"sr_cond": True}, "open_stream.options.sr_cond must be an integer, number or string, got bool"),
    ({"sr_cond": [16000]}, "got list"),
    ({"sr_cond": float("nan")}, "open_stream.options.sr_cond must be finite, got nan"),
    ({"k%d" % i: i for i in range(17)}, "17 entries; the limit is 16"),
    ("sr_cond=16000", "open_stream.options must be a map, got str"),
])
def test_open_stream_bad_options(options, fragment):
    header = {"type": "open_stream", "request_id": 1, "stream_id": "s", "options": options}
    with pytest.raises(ProtocolError) as info:
        decode_client_message([msgpack.packb(header)])
    assert info.value.code == ErrorCode.INVALID_ARGUMENT and fragment in info.value.message


def test_latents_inline_and_cuda_ipc_descriptors_parse():
    array = _latents()
    desc, frames = InlineTransport().pack(array, first_frame=1)
    assert desc.dtype == "float32" and desc.shape == (D, 5)
    parsed = decode_client_message(encode(Decode(3, (Chunk("s", 0, desc),)), frames))
    assert parsed.chunks[0].codes == desc
    ipc = TensorDesc("bfloat16", (D, 4), CudaIpcLoc(1, 0, D * 4 * 2))
    parsed = decode_client_message(encode(Decode(4, (Chunk("s", 0, ipc, codes_event=0),))))
    assert parsed.chunks[0].codes.dtype == "bfloat16"
    half = TensorDesc("float16", (D, 5), InlineLoc(1))
    with pytest.raises(ProtocolError, match="float32/bfloat16 for latents, got float16"):
        decode_client_message(encode(Decode(5, (Chunk("s", 0, half),)), [bytes(D * 5 * 2)]))


def test_client_converts_latents():
    array = _latents()
    assert as_wire_inputs(array) is not None and as_wire_inputs(array).dtype == np.float32
    assert np.array_equal(as_wire_inputs(torch.from_numpy(array).double()), array)
    from_bf16 = as_wire_inputs(torch.from_numpy(array).to(torch.bfloat16))  # numpy has no bfloat16: float32 copy
    assert from_bf16.dtype == np.float32 and np.abs(from_bf16 - array).max() < 0.05
    assert as_wire_inputs(np.zeros((16, 3), dtype=np.int64)).dtype == np.int64  # codes take the codes path
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        as_wire_inputs(np.full((D, 2), np.inf, dtype=np.float32))
    with pytest.raises(InvalidArgument, match=r"\[latent_dim, num_frames\]"):
        as_wire_inputs(np.zeros((1, D, 2), dtype=np.float32))
    widened = cuda_wire_inputs(torch.ones(D, 3, dtype=torch.bfloat16))  # device latents go as float32 (CPU here)
    assert widened.dtype == torch.float32 and widened.is_contiguous() and float(widened.sum()) == D * 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sidecar_reads_inline_latents(dtype):
    values = torch.from_numpy(_latents()).to(getattr(torch, dtype))  # [D, 5]
    raw = values.view(torch.int16).numpy().tobytes() if dtype == "bfloat16" else values.numpy().tobytes()
    desc = TensorDesc(dtype, (D, 5), InlineLoc(1))
    latents = inline_latents(desc, [b"header", raw], D, "voxcpm2")
    assert latents.dtype == values.dtype and torch.equal(latents, values)


def test_sidecar_rejects_bad_latents():
    raw = _latents().tobytes()
    with pytest.raises(ChunkRejected, match=r"needs \[16, n\] \(channels first"):
        inline_latents(TensorDesc("float32", (D, 5), InlineLoc(1)), [b"h", raw], 16, "tiny")
    with pytest.raises(ChunkRejected, match=r"decodes float latents: expected float32 or bfloat16 \[64, n\], got int64"):
        inline_latents(TensorDesc("int64", (D, 5), InlineLoc(1)), [b"h", bytes(D * 5 * 8)], D, "voxcpm2")
    nan = _latents()
    nan[3, 2] = np.nan
    with pytest.raises(ChunkRejected, match="non-finite value"):
        inline_latents(TensorDesc("float32", (D, 5), InlineLoc(1)), [b"h", nan.tobytes()], D, "voxcpm2")
    with pytest.raises(ChunkRejected, match="holds 1280 bytes"):
        inline_latents(TensorDesc("float32", (D, 6), InlineLoc(1)), [b"h", raw], D, "voxcpm2")
    with pytest.raises(ChunkRejected, match="non-finite"):
        check_finite(torch.tensor([[1.0, -float("inf")]]))
    check_finite(torch.zeros(D, 0))


def test_stream_options_per_family():
    assert sr_cond_hz({}, 48000, "voxcpm2") == 48000
    assert sr_cond_hz({"sr_cond": 16000}, 48000, "voxcpm2") == 16000
    with pytest.raises(ChunkRejected, match="has no stream option 'sr_rate' \\(its options: sr_cond\\)"):
        sr_cond_hz({"sr_rate": 16000}, 48000, "voxcpm2")
    with pytest.raises(ChunkRejected, match="must be int, got float"):
        sr_cond_hz({"sr_cond": 16000.0}, 48000, "voxcpm2")
    with pytest.raises(ChunkRejected, match="not a sample rate in Hz"):
        sr_cond_hz({"sr_cond": 0}, 48000, "voxcpm2")
    with pytest.raises(ChunkRejected, match="model 'qwen3-tts-12hz' has no stream option 'sr_cond' \\(its options: none\\)"):
        stream_options({"sr_cond": 16000}, {}, "qwen3-tts-12hz")
    assert proto.LATENT_DTYPES == frozenset({"float32", "bfloat16"})
