"""bfloat16 latents on the wire: a real ``code2wav-sidecar serve`` on the tiny VoxCPM2 golden folder
(``tests/data/golden/voxcpm2_tiny_a``, fp32 model on CPU) and the real client over ipc://.

bfloat16 latents decode like the same values sent as float32 (``x.bfloat16().float()``), inline from the
client and as raw bits from a hand-driven peer; bfloat16 NaN/inf are refused per chunk and the stream goes on;
float16 is refused by the server naming the dtypes and the shape, and by the client before sending; the
welcome lists both dtypes. The client's wire forms are checked without a server, the server's CUDA IPC read on
host memory standing in for a region. The CUDA test sends bfloat16 CUDA latents by CUDA IPC against the float32
path (and against an inline send) on a GPU sidecar.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from code2wav import proto
from code2wav.client import SidecarClient
from code2wav.client import errors as cerr
from code2wav.client.wire_tensors import HostBfloat16, InlineTransport, as_wire_codes, audio_from_frames, host_wire
from code2wav.loadgen.server_metrics import metric_value
from conftest import VOXCPM2_TINY, start_sidecar
from test_server_e2e import RawPeer

TOL = 1e-5
CHUNKS = (1, 16, 40)  # 57 frames, as the golden's chunking
D = 16  # the tiny folder's latent channels
ERRORS = "code2wav_sidecar_errors_total"


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    return torch.from_numpy(load_file(str(VOXCPM2_TINY / "cases.safetensors"))["latents"][0])  # [D, T] float32


@pytest.fixture(scope="module")
def voxcpm2_sidecar(tmp_path_factory):
    running = start_sidecar(tmp_path_factory.mktemp("voxcpm2-bf16"), model=str(VOXCPM2_TINY))
    yield running
    running.stop()


def _decode_chunks(stream, latents: torch.Tensor) -> torch.Tensor:
    """``latents`` ``[D, T]`` (any dtype, any device) chunk by chunk (``CHUNKS``) on ``stream`` -> audio ``[T * U]``."""
    outs, start = [], 0
    for i, num_frames in enumerate(CHUNKS):
        outs.append(stream.decode(latents[:, start:start + num_frames], final=i == len(CHUNKS) - 1).cpu())
        start += num_frames
    return torch.cat(outs)


def _bf16_bits(values: torch.Tensor) -> bytes:
    """A bfloat16 tensor's wire bytes, built without torch's bfloat16 view: the float32's top 16 bits."""
    as_float32 = values.float().numpy()  # exact: every bfloat16 is a float32
    return (as_float32.view("<u4") >> 16).astype("<u2").tobytes()


def test_welcome_lists_float32_and_bfloat16(voxcpm2_sidecar):
    with SidecarClient(voxcpm2_sidecar.address, timeout_s=30) as client:
        info = client.models[0]
        stream = client.open_stream("dtypes")
    assert (info.input_kind, info.input_dtypes, info.channels) == ("latents", ("float32", "bfloat16"), D)
    assert stream.input_dtypes == ("float32", "bfloat16")


def test_bf16_latents_decode_like_the_same_values_in_float32(voxcpm2_sidecar, latents):
    rounded = latents.bfloat16()  # [D, T]
    with SidecarClient(voxcpm2_sidecar.address, timeout_s=60) as client:
        via_bf16 = _decode_chunks(client.open_stream("bf16"), rounded)
        via_f32 = _decode_chunks(client.open_stream("f32"), rounded.float())
        full_precision = _decode_chunks(client.open_stream("full"), latents)
    assert via_bf16.shape == via_f32.shape == (latents.shape[1] * 240,)
    assert (via_bf16 - via_f32).abs().max() <= TOL
    assert (via_bf16 - full_precision).abs().max() > 100 * TOL  # the rounding shows: the check above can fail


def test_bf16_nan_and_inf_are_refused_per_chunk_and_the_stream_goes_on(voxcpm2_sidecar, latents):
    rounded = latents.bfloat16()
    before = metric_value(voxcpm2_sidecar.scrape(), ERRORS, code="invalid_argument")
    with SidecarClient(voxcpm2_sidecar.address, timeout_s=60) as client:
        stream = client.open_stream("bad-bf16")
        for bad_value in (float("nan"), float("inf"), float("-inf")):
            bad = rounded[:, :4].clone()
            bad[3, 2] = bad_value
            with pytest.raises(cerr.InvalidArgument, match=rf"non-finite value .*shape \[{D}, n\]"):
                stream.decode(bad)
        assert stream.next_seq == 0  # refused chunks take no seq: the same stream decodes the whole utterance
        audio = _decode_chunks(stream, rounded)
        reference = _decode_chunks(client.open_stream("ref"), rounded.float())
    assert (audio - reference).abs().max() <= TOL
    after = metric_value(voxcpm2_sidecar.scrape(), ERRORS, code="invalid_argument")
    assert after - before == 3


def test_float16_is_refused_by_the_client_before_sending_and_by_the_server(voxcpm2_sidecar, latents):
    before = metric_value(voxcpm2_sidecar.scrape(), ERRORS, code="invalid_argument")
    with SidecarClient(voxcpm2_sidecar.address, timeout_s=30) as client:
        stream = client.open_stream("half")
        for half in (latents[:, :3].half(), latents[:, :3].half().numpy()):
            with pytest.raises(cerr.InvalidArgument, match=r"latents in float16 are not accepted: the model takes "
                                                          r"float32/bfloat16 of shape \[D, n\]"):
                stream.decode(half)
    assert metric_value(voxcpm2_sidecar.scrape(), ERRORS, code="invalid_argument") == before  # nothing was sent
    peer = RawPeer(voxcpm2_sidecar.address)  # what the client refuses to send: the server's own check
    try:
        peer.hello()
        peer.open_stream(2, "raw")
        desc = {"dtype": "float16", "shape": [D, 3], "loc": "inline", "frame": 1}
        chunk = {"stream_id": "raw", "seq": 0, "final": False, "context_frames": 0, "codes": desc}
        peer.send(msgpack.packb({"type": "decode", "request_id": 3, "chunks": [chunk]}),
                  latents[:, :3].half().numpy().astype("<f2").tobytes())
        error = peer.recv().results[0].error  # scoped to the chunk, not the message
        assert error is not None and error.code == proto.ErrorCode.INVALID_ARGUMENT
        assert f"latents must be float32/bfloat16 of shape [{D}, n]" in error.message and "got float16" in \
            error.message, error.message
    finally:
        peer.close()


def test_raw_bf16_bits_are_widened_exactly_and_checked(voxcpm2_sidecar, latents):
    """The server's reading of bfloat16 frames, independent of the client: raw little-endian bits built here
    decode like the same values sent by the client as float32; a NaN bit pattern is refused per chunk while
    the other stream's chunk in the same message still decodes."""
    rounded = latents[:, :CHUNKS[1]].bfloat16()  # [D, 16]
    with SidecarClient(voxcpm2_sidecar.address, timeout_s=30) as client:
        reference = client.open_stream("raw-ref").decode(rounded.float())  # [16 * U]
    nan_bits = bytearray(_bf16_bits(rounded[:, :2]))
    nan_bits[10:12] = (0x7FC0).to_bytes(2, "little")  # element [2, 1] of [D, 2]: a quiet NaN
    peer = RawPeer(voxcpm2_sidecar.address)
    try:
        peer.hello()
        for rid, stream_id in ((2, "raw-nan"), (3, "raw")):
            peer.open_stream(rid, stream_id)
        chunks = [{"stream_id": "raw-nan", "seq": 0, "final": False, "context_frames": 0,
                   "codes": {"dtype": "bfloat16", "shape": [D, 2], "loc": "inline", "frame": 1}},
                  {"stream_id": "raw", "seq": 0, "final": False, "context_frames": 0,
                   "codes": {"dtype": "bfloat16", "shape": list(rounded.shape), "loc": "inline", "frame": 2}}]
        peer.send(msgpack.packb({"type": "decode", "request_id": 4, "chunks": chunks}), bytes(nan_bits),
                  _bf16_bits(rounded))
        frames = peer.sock.recv_multipart()
    finally:
        peer.close()
    refused, decoded = proto.decode_server_message(frames).results
    assert refused.error is not None and refused.error.code == proto.ErrorCode.INVALID_ARGUMENT
    assert f"non-finite value (NaN or inf); expected finite floats of shape [{D}, n]" in refused.error.message
    assert decoded.error is None and decoded.audio is not None
    audio = audio_from_frames(decoded.audio, frames)
    assert audio.shape == reference.shape and (audio - reference).abs().max() <= TOL


def test_client_wire_forms_of_latents():
    """Without a server: host bfloat16 goes inline as its bits (no copy), float32 as itself, float64 as
    float32; a dtype the model does not list is refused before anything is packed."""
    both = ("float32", "bfloat16")
    values = torch.randn(D, 5).bfloat16()  # [D, 5]
    wire = as_wire_codes(values, latents=True, latent_dtypes=both)
    assert isinstance(wire, HostBfloat16) and wire.shape == (D, 5) and wire.nbytes == D * 5 * 2
    assert wire.bits.ctypes.data == values.data_ptr()  # shares memory
    desc, frames = InlineTransport().pack(wire, first_frame=1)
    assert desc == proto.TensorDesc("bfloat16", (D, 5), proto.InlineLoc(1))
    assert bytes(frames[0]) == _bf16_bits(values)
    transposed = torch.randn(5, D).bfloat16().t()  # [D, 5], not contiguous: one copy, same values
    bits = as_wire_codes(transposed, latents=True, latent_dtypes=both).bits
    assert (torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16) == transposed).all()
    assert host_wire(wire) is wire and host_wire(values).bits.tobytes() == wire.bits.tobytes()  # CUDA fallback form
    as_f32 = as_wire_codes(values.float(), latents=True, latent_dtypes=both)
    assert as_f32.dtype == np.dtype("<f4") and (as_f32 == values.float().numpy()).all()
    assert as_wire_codes(np.ones((D, 2)), latents=True, latent_dtypes=both).dtype == np.dtype("<f4")  # float64
    with pytest.raises(cerr.InvalidArgument, match=r"latents in bfloat16 are not accepted: the model takes float32 "):
        as_wire_codes(values, latents=True, latent_dtypes=("float32",))  # a server that lists float32 only
    with pytest.raises(cerr.InvalidArgument, match="latents in float16 are not accepted"):
        as_wire_codes(values.half(), latents=True, latent_dtypes=both)
    with pytest.raises(cerr.InvalidArgument, match=r"shape \[channels, num_frames\], got \[80\]"):
        as_wire_codes(values.reshape(-1), latents=True, latent_dtypes=both)


def test_ipc_bf16_regions_are_viewed_as_bf16_widened_exactly_and_checked():
    """The server's CUDA IPC read of bfloat16 latents to the host (a window stream's, which keeps its inputs), on
    host memory standing in for a mapped region (the device side is the CUDA test below): the view is bfloat16;
    one batch mixing bfloat16 and float32 chunks loads both exactly as float32; bfloat16 NaN/inf chunks are refused
    per chunk, naming the shape. (An exact stream's stay on the device, checked by the step: test_poisoned_stream.)"""
    from types import SimpleNamespace

    from code2wav.sidecar.ipc.io import load_codes
    from code2wav.sidecar.jobs import IpcInputs
    from code2wav.sidecar.models import InputSpec
    from code2wav.sidecar.modes import mode_for
    from test_ipc_cpu import _service_with_region, _StandInEvent

    service, region, _ = _service_with_region()
    region.opened.events = [_StandInEvent(True)]
    values = torch.randn(2, 3).bfloat16()  # [D=2, 3]
    nan, inf = values.clone(), values.clone()
    nan[1, 0], inf[0, 2] = float("nan"), float("-inf")
    data = region.opened.data  # [1024] uint8
    for offset, tensor in ((0, values), (256, nan), (512, inf)):
        data[offset:offset + 12] = tensor.reshape(-1).view(torch.uint8)
    data[768:768 + 24] = values.float().reshape(-1).view(torch.uint8)

    def job(dtype: str, offset: int):
        desc = proto.TensorDesc(dtype, (2, 3), proto.CudaIpcLoc(7, offset, 6 * proto.WIRE_DTYPE_ITEMSIZES[dtype]))
        return SimpleNamespace(ipc_codes=IpcInputs(region, service.view(region, desc, "codes"), 0), arrived_s=0.0,
                               codes=None, stream=SimpleNamespace(mode=mode_for(False)))

    jobs = [job("bfloat16", 0), job("bfloat16", 256), job("bfloat16", 512), job("float32", 768)]
    assert jobs[0].ipc_codes.view.dtype == torch.bfloat16 and jobs[3].ipc_codes.view.dtype == torch.float32
    refused, deferred = load_codes(jobs, InputSpec("latents", 2), now_s=0.0, codes_event_timeout_s=5.0, incomplete=[])
    assert deferred == [] and [j for j, _, _ in refused] == jobs[1:3]
    assert all(code == proto.ErrorCode.INVALID_ARGUMENT and "non-finite" in message and "shape [2, n]" in message
               for _, code, message in refused)
    for loaded in (jobs[0], jobs[3]):
        assert loaded.codes.dtype == torch.float32 and torch.equal(loaded.codes, values.float())


@pytest.mark.cuda
def test_bf16_cuda_latents_by_ipc_match_the_float32_path(tmp_path, latents):
    """bfloat16 CUDA latents travel by CUDA IPC as bfloat16 and decode like the same values in float32 (by
    IPC too) and like host bfloat16 sent inline; a NaN over IPC is refused per chunk. fp32 model, TF32 off
    (the config's default)."""
    running = start_sidecar(tmp_path, "--device", "cuda", model=str(VOXCPM2_TINY))
    try:
        rounded = latents.bfloat16()  # [D, T]
        with SidecarClient(running.address, timeout_s=120) as client:
            assert client.server_info.capabilities["cuda_ipc"] is True
            stream = client.open_stream("ipc-bf16")
            bad = rounded[:, :4].cuda()
            bad[0, 1] = float("nan")
            with pytest.raises(cerr.InvalidArgument, match="seq 0 holds a latent that is not finite .*checked on the "
                               "GPU: the latents came from a CUDA IPC region.*send seq 0 again"):
                stream.decode(bad)
            via_bf16 = _decode_chunks(stream, rounded.cuda())
            via_f32 = _decode_chunks(client.open_stream("ipc-f32"), rounded.float().cuda())
            inline = _decode_chunks(client.open_stream("inline-bf16"), rounded)
            stats = client.ipc_stats
        assert stats["ipc_chunks"] == 1 + 2 * len(CHUNKS), stats
        assert not [k for k in stats if k.startswith("inline_fallback")], stats
        assert (via_bf16 - via_f32).abs().max() <= TOL
        assert (via_bf16 - inline).abs().max() <= TOL
    finally:
        running.stop()
