"""CUDA IPC between two processes on a real GPU (skipped without one): the test process is the client, the
sidecar is a spawned ``serve`` process. IPC audio equals inline audio exactly; 10,000 chunks leave GPU
memory flat; region lifecycle; typed errors for bad offsets, unknown regions and foreign handles."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

from code2wav import proto
from code2wav.client import SidecarClient
from code2wav.client.cuda_ipc.channel import IpcChannel
from code2wav.loadgen.server_metrics import metric_value as _metric
from code2wav.proto import CudaIpcLoc, ErrorCode, TensorDesc

from conftest import ROOT, start_sidecar
from test_server_e2e import RawPeer

pytestmark = pytest.mark.cuda


def _codes(q: int, n: int, seed: int, codebook: int = 2048) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, codebook, (q, n), generator=gen)


def test_ipc_audio_equals_inline_exactly(gpu_sidecar, golden_cases):
    codes = golden_cases["codes"][1]  # [Q, T]
    full = golden_cases["full"][1, 0]
    cuts = [0, 1, 4, 29, 30, codes.shape[1]]
    with SidecarClient(gpu_sidecar.address) as c:
        assert c.server_info.capabilities["cuda_ipc"] is True
        for mode in ("exact", "window"):
            via_ipc = c.open_stream(f"ipc-{mode}", mode=mode, left_context_frames=3)
            inline = c.open_stream(f"inline-{mode}", mode=mode, left_context_frames=3)
            outs = []
            for start, end in zip(cuts, cuts[1:]):
                a = via_ipc.decode(codes[:, start:end].cuda())
                b = inline.decode(codes[:, start:end])
                assert a.is_cuda and not b.is_cuda
                assert torch.equal(a.cpu(), b), (mode, start, torch.max(torch.abs(a.cpu() - b)))
                outs.append(a.cpu())
            if mode == "exact":
                torch.testing.assert_close(torch.cat(outs), full, rtol=0, atol=1e-4)
        # on a side stream: codes made there, audio ordered there (the reply does not wait for the decode)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            s_side, s_ref = c.open_stream("side"), c.open_stream("side-ref")
            for start, end in zip(cuts, cuts[1:]):
                a = s_side.decode(codes[:, start:end].pin_memory().cuda(non_blocking=True))
                b = s_ref.decode(codes[:, start:end])
                assert torch.equal(a.cpu(), b), (start, end)
        # one message mixing CUDA and host codes: each goes its own way, results in order
        s1, s2 = c.open_stream("mix-1"), c.open_stream("mix-2")
        a, b = c.decode_batch([(s1, codes[:, :5].cuda()), (s2, codes[:, :5])])
        assert a.is_cuda and not b.is_cuda
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=1e-6)
        stats = c.ipc_stats
    assert stats["ipc_chunks"] == 3 * (len(cuts) - 1) + 1
    assert not [k for k in stats if k.startswith("inline_fallback")], stats
    text = gpu_sidecar.scrape()
    assert _metric(text, "code2wav_sidecar_ipc_chunks_total", direction="audio_out") >= stats["ipc_chunks"]


def test_concurrent_callers_on_their_own_streams_each_match_the_reference(gpu_sidecar, golden_cases):
    """Twelve callers at once, each on a CUDA stream of its own and with its own chunking (1 to 7 frames):
    whatever batch company each chunk gets, every stream's audio equals the full decode of its codes."""
    codes, full = golden_cases["codes"], golden_cases["full"]  # [cases, Q, 40], [cases, 1, 40 * U]
    errors: list[BaseException] = []

    def steps_and_chunks() -> tuple[float, float]:
        text = gpu_sidecar.scrape()
        return tuple(_metric(text, f"code2wav_sidecar_batch_size_{kind}", mode="exact") for kind in ("count", "sum"))

    steps_before, chunks_before = steps_and_chunks()
    with SidecarClient(gpu_sidecar.address) as c:

        def caller(index: int) -> None:
            try:
                case, size = index % codes.shape[0], 1 + index % 7
                own = torch.cuda.Stream()
                with torch.cuda.stream(own):
                    stream = c.open_stream(f"own-stream-{index}")
                    outs = [stream.decode(codes[case, :, start:start + size].cuda()).cpu()  # .cpu() waits on `own`
                            for start in range(0, codes.shape[2], size)]
                torch.testing.assert_close(torch.cat(outs), full[case, 0], rtol=0, atol=1e-4)
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = c.ipc_stats
    assert not errors, errors
    assert stats["ipc_chunks"] == sum(-(-codes.shape[2] // (1 + i % 7)) for i in range(12))
    assert not [k for k in stats if k.startswith("inline_fallback")], stats
    steps_after, chunks_after = steps_and_chunks()
    assert chunks_after - chunks_before == stats["ipc_chunks"]
    assert steps_after - steps_before < stats["ipc_chunks"], "no two chunks shared a step: no batch company tested"


def test_context_frames_full_region_fallback_and_resend(gpu_sidecar, golden_cases):
    codes = golden_cases["codes"][1]  # [Q, 40]; the tiny model gives 48 samples (192 bytes) per frame
    with SidecarClient(gpu_sidecar.address, ipc_audio_nbytes=4096) as c, \
            SidecarClient(gpu_sidecar.address, cuda_ipc=False) as ref_client:
        assert c.models[0].samples_per_frame == 48
        s, ref = c.open_stream("ctx"), ref_client.open_stream("ctx-ref")
        first = s.decode(codes[:, :10].cuda(), context_frames=4)  # frames 0-3: state only, no audio
        assert first.is_cuda and torch.equal(first.cpu(), ref.decode(codes[:, :10], context_frames=4))
        del first  # its slot returns to the region
        held = s.decode(codes[:, 10:25].cuda())  # 15 frames: 3072 of the 4096 bytes while `held` lives
        assert torch.equal(held.cpu(), ref.decode(codes[:, 10:25]))
        spill = s.decode(codes[:, 25:35].cuda())  # no room: sent inline, and still CUDA audio
        assert spill.is_cuda and torch.equal(spill.cpu(), ref.decode(codes[:, 25:35]))
        assert c.ipc_stats["inline_fallback:region_full"] == 1 and c.ipc_stats["ipc_chunks"] == 2
        del held
        again = s.resend()  # the last chunk again, by IPC now; the sidecar answers a resend inline
        assert again.is_cuda and torch.equal(again.cpu(), spill.cpu()) and s.next_seq == 3
        last = s.decode(codes[:, 35:].cuda(), final=True)
        assert torch.equal(last.cpu(), ref.decode(codes[:, 35:], final=True))
        assert c.ipc_stats["ipc_chunks"] == 4 and c.ipc_stats["inline_fallback:region_full"] == 1


def test_ten_thousand_chunks_leave_gpu_memory_flat(gpu_sidecar):
    num_streams, total = 8, 10_000
    with SidecarClient(gpu_sidecar.address) as c:
        q = c.models[0].num_quantizers
        streams = [c.open_stream(f"flat-{i}", mode="window", left_context_frames=2) for i in range(num_streams)]
        codes = _codes(q, 1, 0, c.models[0].codebook_size).cuda()

        def run(num_messages: int) -> None:
            for _ in range(num_messages):
                outs = c.decode_batch([(s, codes) for s in streams])
                assert all(o.is_cuda and o.numel() == streams[0].samples_per_frame for o in outs)
                del outs  # release the audio views: their slots go back to the region

        run(50)  # warm-up: regions registered, buckets used, allocator caches filled
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]  # device-wide: the sidecar process is included
        client_before = torch.cuda.memory_allocated()
        run(total // num_streams)
        torch.cuda.synchronize()
        free_after = torch.cuda.mem_get_info()[0]
        client_after = torch.cuda.memory_allocated()
        link_channel = c._ipc.ready(codes.device)
        assert link_channel is not None
        usage = link_channel.stats()
        stats = c.ipc_stats
    print(f"\n10k IPC chunks: device free {free_before / 2**20:.1f} -> {free_after / 2**20:.1f} MiB, client "
          f"allocated {client_before} -> {client_after} B, slots in use {usage}")
    assert stats["ipc_chunks"] == (50 + total // num_streams) * num_streams
    assert abs(free_after - free_before) <= 8 * 2**20
    # no growth (process-wide: a tensor of an earlier test collected meanwhile may make it smaller)
    assert client_after <= client_before
    assert usage["codes_bytes_in_use"] == 0 and usage["live_audio_views"] == 0, usage
    assert usage["audio_bytes_in_use"] <= num_streams * 8192, usage  # the last views return at the next send


class IpcPeer(RawPeer):
    """A raw DEALER plus an exported channel, for messages the client library would never send."""

    def __init__(self, address: str, codes_nbytes: int = 1 << 16, audio_nbytes: int = 1 << 22) -> None:
        super().__init__(address)
        self.sock.setsockopt(zmq.RCVTIMEO, 20_000)
        self.welcome = self.hello()
        # 16 codes events, so indices 16..63 are valid on the wire but not registered
        self.channel = IpcChannel(torch.device("cuda", 0), codes_nbytes, audio_nbytes, num_events=16)
        self.codes_nbytes = codes_nbytes
        for msg in self.channel.register_messages(2):
            self.send(msg)
        codes_reply, audio_reply = self.recv(), self.recv()
        assert isinstance(codes_reply, proto.RegionRegistered), codes_reply
        self.channel.adopt(0, codes_reply.region_id, audio_reply.region_id, audio_reply.events)
        self.spf = self.welcome.models[0].samples_per_frame
        self.q = self.welcome.models[0].num_quantizers
        self.codebook = self.welcome.models[0].codebook_size

    def open(self, stream_id: str) -> None:
        self.send(proto.OpenStream(10, stream_id))
        assert isinstance(self.recv(), proto.Opened)

    def chunk(self, stream_id: str, seq: int, values: torch.Tensor, **changes) -> tuple[proto.Chunk, object]:
        packed = self.channel.pack([values.cuda()], [values.shape[1] * self.spf])[0]
        fields = {"codes": packed.codes, "codes_event": packed.codes_event, "audio_out": packed.audio_out}
        fields.update(changes)
        return proto.Chunk(stream_id, seq, fields["codes"], codes_event=fields["codes_event"],
                           audio_out=fields["audio_out"]), packed


def _moved(desc: TensorDesc, **loc_changes) -> TensorDesc:
    loc = desc.loc
    fields = {"region_id": loc.region_id, "offset": loc.offset, "nbytes": loc.nbytes, **loc_changes}
    return TensorDesc(desc.dtype, desc.shape, CudaIpcLoc(**fields))


def test_bad_offsets_unknown_regions_and_foreign_handles_get_typed_errors(gpu_sidecar, golden_cases):
    codes, full = golden_cases["codes"][1], golden_cases["full"][1, 0]
    with SidecarClient(gpu_sidecar.address) as healthy:
        good = healthy.open_stream("healthy")
        outs = [good.decode(codes[:, :6].cuda())]
        peer, other = IpcPeer(gpu_sidecar.address), IpcPeer(gpu_sidecar.address)
        try:
            peer.open("s")
            sample = codes[:, :4]
            chunk, packed = peer.chunk("s", 0, sample)
            codes_region = packed.codes.loc.region_id
            cases = [
                ("codes past the end", {"codes": _moved(packed.codes, offset=peer.codes_nbytes - 8)},
                 ErrorCode.INVALID_ARGUMENT, "outside the region"),
                ("misaligned codes", {"codes": _moved(packed.codes, offset=packed.codes.loc.offset + 4)},
                 ErrorCode.INVALID_ARGUMENT, "alignment"),
                ("unknown region", {"codes": _moved(packed.codes, region_id=99_999)}, ErrorCode.NOT_FOUND,
                 "not registered"),
                ("another client's region", {"codes": _moved(packed.codes,
                                                              region_id=other.channel.codes_region)},
                 ErrorCode.NOT_FOUND, "not registered"),
                ("codes in the audio region", {"codes": _moved(packed.codes, region_id=packed.audio_out.loc.region_id)},
                 ErrorCode.INVALID_ARGUMENT, "registered for write"),
                ("audio past the end", {"audio_out": _moved(packed.audio_out, offset=(1 << 22) - 64)},
                 ErrorCode.INVALID_ARGUMENT, "outside the region"),
                ("audio of the wrong length", {"audio_out": TensorDesc("float32", (7,), CudaIpcLoc(
                    packed.audio_out.loc.region_id, 0, 28))}, ErrorCode.INVALID_ARGUMENT, "gives"),
                ("unregistered event", {"codes_event": 40}, ErrorCode.INVALID_ARGUMENT, "codes_event 40"),
            ]
            for rid, (name, changes, code, needle) in enumerate(cases, start=100):
                bad, _ = peer.chunk("s", 0, sample, **changes)
                peer.send(proto.Decode(rid, (bad,)))
                reply = peer.recv()
                assert isinstance(reply, proto.DecodeResult), (name, reply)
                error = reply.results[0].error
                assert error is not None and error.code == code and needle in error.message, (name, error)
                outs.append(good.decode(codes[:, len(outs) + 5: len(outs) + 6].cuda()))  # meanwhile, all is well
            bad_codes = sample.clone()
            bad_codes[0, 0] = 5000  # outside the codebook, caught before any kernel sees it
            chunk, _ = peer.chunk("s", 0, bad_codes)
            peer.send(proto.Decode(200, (chunk,)))
            error = peer.recv().results[0].error
            assert error.code == ErrorCode.INVALID_ARGUMENT and "out of range" in error.message
            chunk, packed = peer.chunk("s", 0, sample)  # the same seq again: nothing was committed
            peer.send(proto.Decode(201, (chunk,)))
            reply = peer.recv()
            assert reply.results[0].error is None and reply.results[0].audio.loc == packed.audio_out.loc
            # registrations that cannot work
            uuid = peer.welcome.capabilities["gpu_uuid"]
            spare = IpcChannel(torch.device("cuda", 0), 4096, 4096)  # exported, never registered
            handle = spare.register_messages(0)[1].ipc_handle
            refusals = [
                (proto.RegisterRegion(300, "GPU-00000000-0000-0000-0000-000000000000", handle, 1024, "write"),
                 "same GPU"),
                (proto.RegisterRegion(301, uuid, "ab" * 64, 1024, "write"), "cannot open"),
                (proto.RegisterRegion(302, uuid, handle, 1 << 40, "write"), "claims"),
            ]
            for msg, needle in refusals:
                peer.send(msg)
                reply = peer.recv()
                assert isinstance(reply, proto.Error) and reply.code == ErrorCode.INVALID_ARGUMENT, reply
                assert needle in reply.message, reply.message
            peer.send(proto.UnregisterRegion(303, 424242))
            reply = peer.recv()
            assert isinstance(reply, proto.Error) and reply.code == ErrorCode.NOT_FOUND
            assert codes_region == peer.channel.codes_region
        finally:
            peer.close()
            other.close()
        rest = codes[:, len(outs) + 5:]
        outs.append(good.decode(rest.cuda()))
        got = torch.cat([o.cpu() for o in outs])
    torch.testing.assert_close(got, full, rtol=0, atol=1e-4)


def test_unregister_in_flight_is_deferred_until_the_chunk_is_done(gpu_sidecar):
    peer = IpcPeer(gpu_sidecar.address, codes_nbytes=1 << 20, audio_nbytes=1 << 26)
    try:
        peer.open("long")
        chunk, packed = peer.chunk("long", 0, _codes(peer.q, 200, 1, peer.codebook))  # a slow chunk: 200 frames
        peer.send(proto.Decode(50, (chunk,)))
        peer.send(proto.UnregisterRegion(51, packed.codes.loc.region_id))
        first, second = peer.recv(), peer.recv()
        assert isinstance(first, proto.DecodeResult) and first.results[0].error is None, first
        assert isinstance(second, proto.RegionUnregistered) and second.request_id == 51
        later, _ = peer.chunk("long", 1, _codes(peer.q, 2, 2, peer.codebook))
        peer.send(proto.Decode(52, (later,)))
        error = peer.recv().results[0].error
        assert error.code == ErrorCode.NOT_FOUND and "not registered" in error.message
    finally:
        peer.close()


def test_chunk_waits_for_its_codes_event_without_stalling_other_clients(gpu_sidecar, golden_cases):
    codes = golden_cases["codes"][1]
    peer = IpcPeer(gpu_sidecar.address)
    try:
        peer.open("slow")
        chunk, packed = peer.chunk("slow", 0, codes[:, :4])
        channel = peer.channel
        event = channel._events[packed.codes_event]
        with torch.cuda.stream(torch.cuda.Stream()):  # the codes are "still being produced" for ~0.7 s
            torch.cuda._sleep(1_400_000_000)
            event.record()
        peer.send(proto.Decode(60, (chunk,)))
        with SidecarClient(gpu_sidecar.address) as c:
            fast = c.open_stream("fast")
            fast.decode(codes[:, :5].cuda())  # decoded while the slow chunk waits in the queue
            assert not peer.sock.poll(0), "the slow chunk was answered before its codes were ready"
        reply = peer.recv()
        assert isinstance(reply, proto.DecodeResult) and reply.results[0].error is None, reply
    finally:
        peer.close()


_KILLED_CLIENT = """
import sys, time, torch
from code2wav.client import SidecarClient
c = SidecarClient(sys.argv[1])
s = c.open_stream("victim")
q = c.models[0].num_quantizers
for i in range(3):
    s.decode(torch.zeros((q, 2), dtype=torch.long, device="cuda"))
s.submit(torch.zeros((q, 200), dtype=torch.long, device="cuda"))  # in flight when killed
print("registered", c.ipc_stats["ipc_chunks"], flush=True)
time.sleep(60)
"""


def test_killed_client_regions_are_closed_and_others_unharmed(tmp_path, golden_cases):
    sidecar = start_sidecar(tmp_path, "--device", "cuda", "--stream-ttl-s", "2")
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        victim = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, sidecar.address], stdout=subprocess.PIPE,
                                  text=True, env=env)
        line = victim.stdout.readline()
        assert line.startswith("registered 4"), line
        assert _metric(sidecar.scrape(), "code2wav_sidecar_ipc_regions", access="read") == 1
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        codes, full = golden_cases["codes"][1], golden_cases["full"][1, 0]
        with SidecarClient(sidecar.address) as c:
            s = c.open_stream("survivor")
            got = torch.cat([s.decode(codes[:, :10].cuda()).cpu(), s.decode(codes[:, 10:].cuda()).cpu()])
            torch.testing.assert_close(got, full, rtol=0, atol=1e-4)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if _metric(sidecar.scrape(), "code2wav_sidecar_ipc_regions", access="read") == 1:
                    break  # only the survivor's region is left
                time.sleep(0.25)
            assert _metric(sidecar.scrape(), "code2wav_sidecar_ipc_regions", access="read") == 1
            assert _metric(sidecar.scrape(), "code2wav_sidecar_ipc_regions", access="write") == 1
    finally:
        sidecar.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_region_on_another_gpu_is_refused_even_with_a_spoofed_uuid(gpu_sidecar):
    peer = RawPeer(gpu_sidecar.address)
    try:
        welcome = peer.hello()
        channel = IpcChannel(torch.device("cuda", 1), 1 << 16, 1 << 16)
        msg = channel.register_messages(2)[1]
        spoofed = proto.RegisterRegion(2, welcome.capabilities["gpu_uuid"], msg.ipc_handle, msg.nbytes, "write")
        peer.send(spoofed)
        reply = peer.recv()
        assert isinstance(reply, proto.Error) and reply.code == ErrorCode.INVALID_ARGUMENT
        assert "device 1" in reply.message or "cannot open" in reply.message, reply.message
    finally:
        peer.close()
