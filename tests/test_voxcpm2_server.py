"""VoxCPM2's AudioVAE decoder served end to end: a real ``code2wav-sidecar serve`` on the tiny golden folder
(``tests/data/golden/voxcpm2_tiny_a``), the real client over ipc://, exact streams against the golden one-shot
decodes (``full`` at the default sr_cond, ``full_sr_cond`` at 16000 / 32000 Hz per row), two streams with
different sr_cond in one forward, and typed errors for bad latents, a bad option, and sr_cond on a codes model.
The CUDA test runs the same model in-process with graphs captured (fp32, TF32 off) against the eager decode.
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
from conftest import VOXCPM2_TINY, start_sidecar
from test_server_e2e import RawPeer, _metric

TOL = 1e-5
CHUNKS = (1, 16, 40)  # the golden's chunking: 57 frames
D = 16  # the tiny folder's latent channels


@pytest.fixture(scope="module")
def cases() -> dict[str, np.ndarray]:
    return load_file(str(VOXCPM2_TINY / "cases.safetensors"))


@pytest.fixture(scope="module")
def voxcpm2_sidecar(tmp_path_factory):
    running = start_sidecar(tmp_path_factory.mktemp("voxcpm2"), model=str(VOXCPM2_TINY))
    yield running
    running.stop()


def _stream(client: SidecarClient, stream_id: str, latents: np.ndarray, options: dict[str, int] | None = None
            ) -> np.ndarray:
    """``latents`` ``[D, T]`` decoded chunk by chunk (``CHUNKS``) on one exact stream -> audio ``[T * U]``."""
    stream = client.open_stream(stream_id, options=options)
    outs, start = [], 0
    for i, num_frames in enumerate(CHUNKS):
        outs.append(stream.decode(latents[:, start:start + num_frames], final=i == len(CHUNKS) - 1))
        start += num_frames
    return torch.cat(outs).numpy()


def test_welcome_describes_the_latents_contract(voxcpm2_sidecar):
    with SidecarClient(voxcpm2_sidecar.address, timeout_s=30) as client:
        info = client.models[0]
    assert (info.family, info.input_kind, info.input_dtypes, info.channels, info.valid_range) == (
        "voxcpm2_audiovae", "latents", ("float32", "bfloat16"), D, None)
    assert (info.sample_rate, info.samples_per_frame) == (48000, 240)
    assert [(o.name, o.low, o.high, o.default) for o in info.stream_options] == [("sr_cond", 1, 192000, 48000)]


def test_exact_streams_match_the_golden(voxcpm2_sidecar, cases):
    latents, full, full_sr = cases["latents"], cases["full"][:, 0], cases["full_sr_cond"][:, 0]
    with SidecarClient(voxcpm2_sidecar.address, timeout_s=60) as client:
        for row in range(2):
            audio = _stream(client, f"row{row}", latents[row])
            assert audio.shape == full[row].shape
            assert np.abs(audio - full[row]).max() <= TOL, row
        for row, hz in enumerate(cases["sr_cond"].tolist()):  # 16000 Hz (bucket 0), 32000 Hz (bucket 2)
            audio = _stream(client, f"sr{row}", latents[row], {"sr_cond": hz})
            assert np.abs(audio - full_sr[row]).max() <= TOL, (row, hz)
            assert np.abs(audio - full[row]).max() > 100 * TOL  # the condition changes the audio


def test_two_streams_with_different_sr_cond_share_forwards(voxcpm2_sidecar, cases):
    latents, full_sr = cases["latents"], cases["full_sr_cond"][:, 0]
    before = voxcpm2_sidecar.scrape()
    with SidecarClient(voxcpm2_sidecar.address, timeout_s=60) as client:
        streams = [client.open_stream(f"pair{row}", options={"sr_cond": hz})
                   for row, hz in enumerate(cases["sr_cond"].tolist())]
        outs: list[list[torch.Tensor]] = [[], []]
        start = 0
        for i, num_frames in enumerate(CHUNKS):
            final = i == len(CHUNKS) - 1
            items = [(s, latents[row, :, start:start + num_frames], {"final": final}) for row, s in enumerate(streams)]
            for row, audio in enumerate(client.decode_batch(items)):  # one decode message, both rows
                outs[row].append(audio)
            start += num_frames
    for row in range(2):
        assert np.abs(torch.cat(outs[row]).numpy() - full_sr[row]).max() <= TOL, row
    after = voxcpm2_sidecar.scrape()
    def delta(name: str) -> float:
        return _metric(after, name) - _metric(before, name)

    forwards, chunks = delta("code2wav_sidecar_batch_size_count"), delta("code2wav_sidecar_batch_size_sum")
    assert chunks == 2 * len(CHUNKS) and forwards < chunks  # rows of different sr_cond shared a forward


def test_bad_latents_and_options_are_typed_errors_and_the_server_keeps_serving(voxcpm2_sidecar, cases):
    with SidecarClient(voxcpm2_sidecar.address, timeout_s=60) as client:
        stream = client.open_stream("nan")
        bad = cases["latents"][0, :, :4].copy()
        bad[3, 2] = np.nan
        with pytest.raises(cerr.InvalidArgument, match=rf"non-finite value .*shape \[{D}, n\]"):
            stream.decode(bad)
        with pytest.raises(cerr.InvalidArgument, match=rf"needs {D}"):  # the client's own check
            stream.decode(np.zeros((D - 1, 3), dtype=np.float32))
        with pytest.raises(cerr.InvalidArgument, match=r"'sr_cond' must be an integer in \[1, 192000\], got 0"):
            client.open_stream("zero-hz", options={"sr_cond": 0})
        with pytest.raises(cerr.InvalidArgument, match=r"unknown stream option\(s\) \['sr_rate'\]"):
            client.open_stream("typo", options={"sr_rate": 16000})
        audio = _stream(client, "after", cases["latents"][1])  # the stream that failed nothing still decodes
        assert np.abs(audio - cases["full"][1, 0]).max() <= TOL
    peer = RawPeer(voxcpm2_sidecar.address)  # what the client refuses to send: the server's own checks
    try:
        peer.hello()
        peer.open_stream(2, "raw")
        for rid, shape, dtype, fragment in ((3, [D - 1, 2], "<f4", f"needs {D} (shape [{D}, n])"),
                                            (4, [D, 2], "<i8", f"latents must be float32/bfloat16 of shape [{D}, n]")):
            desc = {"dtype": "float32" if dtype == "<f4" else "int64", "shape": shape, "loc": "inline", "frame": 1}
            chunk = {"stream_id": "raw", "seq": 0, "final": False, "context_frames": 0, "codes": desc}
            peer.send(msgpack.packb({"type": "decode", "request_id": rid, "chunks": [chunk]}),
                      np.zeros(shape, dtype=dtype).tobytes())
            reply = peer.recv()
            error = reply.results[0].error
            assert error is not None and error.code == proto.ErrorCode.INVALID_ARGUMENT, reply
            assert fragment in error.message, error.message
    finally:
        peer.close()


def test_sr_cond_on_a_codes_model_is_rejected(sidecar):
    with SidecarClient(sidecar.address, timeout_s=30) as client:
        assert client.models[0].stream_options == ()
        with pytest.raises(cerr.InvalidArgument, match=r"unknown stream option\(s\) \['sr_cond'\]; this model takes "
                                                      "none"):
            client.open_stream("s", options={"sr_cond": 16000})
        client.open_stream("plain")  # the session goes on


@pytest.mark.cuda
def test_cuda_graphs_match_eager_fp32(tmp_path, cases):
    """The same two sr_cond streams through a server with graphs captured at start-up (fp32, TF32 off: the
    config's default) and one without graphs: within 1e-5 of each other; graph buckets all captured."""
    from test_family_toy import serve  # an in-process Server (the families list includes the built-ins)

    graphs = {"exact_batch_sizes": [1, 2], "exact_frames": [1, 16, 40], "window_batch_sizes": [1],
              "window_frames": [16]}
    results = {}
    for label, graphs_cfg in (("eager", {"enabled": False}), ("graphs", graphs)):
        (tmp_path / label).mkdir()
        running = serve(tmp_path / label, VOXCPM2_TINY, "cuda", graphs=graphs_cfg)
        try:
            assert running.server.model.family.name == "voxcpm2_audiovae"
            with SidecarClient(running.server.address, timeout_s=120) as client:
                results[label] = [_stream(client, f"{label}{row}", cases["latents"][row], {"sr_cond": hz})
                                  for row, hz in enumerate(cases["sr_cond"].tolist())]
            if label == "graphs":
                summary = running.server.engine.graphs.summary()
                assert summary and all(s["status"] == "captured" for s in summary), summary
        finally:
            running.stop()
    for row in range(2):
        assert np.abs(results["graphs"][row] - results["eager"][row]).max() <= TOL, row
        assert np.abs(results["graphs"][row] - cases["full_sr_cond"][row, 0]).max() <= 1e-4, row  # vs the CPU golden
