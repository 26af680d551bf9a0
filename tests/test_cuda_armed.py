"""The device-armed hand-off on a real GPU (skipped without one): the test process is the client, the sidecar a spawned
``serve`` process. A chunk is armed (``codes_token``): the sidecar queues its step behind a GPU wait for the codes'
doorbell word (shared host memory both processes map for the GPU), which the client's stream writes after the codes
(proto/README.md, section 3).

What must hold: armed audio equals the golden decode and the events path bit for bit; a message sent before its codes
exist on the GPU decodes those codes (the step waited for them: reading early would decode the slot's previous
codes); a code out of range is refused by the step on the GPU and the same seq decodes when sent again; a doorbell
rung too late is released after ``armed_wait_s`` (``deadline_exceeded``, the stream's state kept, the seq sent again
decodes); and a client that dies with its chunk armed leaves every other stream served."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from code2wav.client import SidecarClient
from code2wav.client import errors as cerr

from conftest import ROOT, counter_total, start_sidecar

pytestmark = pytest.mark.cuda

ARMED_WAIT_S = 0.3


@pytest.fixture(scope="module")
def armed_sidecar(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("armed")
    config = workdir / "sidecar.yaml"
    config.write_text(f"armed_wait_s: {ARMED_WAIT_S}\n")
    running = start_sidecar(workdir, "--device", "cuda", "--config", str(config))
    yield running
    running.stop()


def _sleep_cycles(ms: float) -> int:
    """``torch.cuda._sleep`` cycles for about ``ms`` milliseconds on this GPU (measured once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * ms / start.elapsed_time(end))


def test_armed_audio_equals_the_golden_decode_and_the_events_path(armed_sidecar, golden_cases):
    codes, full = golden_cases["codes"][1], golden_cases["full"][1, 0]  # [Q, T], [T * U]
    cuts = [0, 1, 4, 29, 30, codes.shape[1]]
    armed_before = counter_total(armed_sidecar, "ipc_armed_chunks")
    with SidecarClient(armed_sidecar.address, ipc_armed=True) as armed, SidecarClient(armed_sidecar.address) as plain:
        a_stream, p_stream = armed.open_stream("armed"), plain.open_stream("events")
        outs = []
        for start, end in zip(cuts, cuts[1:]):
            a = a_stream.decode(codes[:, start:end].cuda())
            p = p_stream.decode(codes[:, start:end].cuda())
            assert a.is_cuda and torch.equal(a.cpu(), p.cpu()), (start, end)
            outs.append(a.cpu())
        assert armed.ipc_stats["ipc_chunks"] == len(cuts) - 1
    torch.testing.assert_close(torch.cat(outs), full, rtol=0, atol=1e-4)
    assert counter_total(armed_sidecar, "ipc_armed_chunks") - armed_before == len(cuts) - 1  # the events client: none


def test_a_message_sent_before_its_codes_exist_decodes_them_once_they_land(armed_sidecar, golden_cases):
    """The caller's stream is busy for 50 ms (a talker's step) before it makes the codes; ``submit`` sends the armed
    message at once. The sidecar's step waits on the GPU: the audio is that of these codes, not of the codes the
    slot held before (the previous chunk's)."""
    codes, full = golden_cases["codes"][0], golden_cases["full"][0, 0]  # [Q, T], [T * U]
    spf = full.numel() // codes.shape[1]
    busy = _sleep_cycles(50.0)
    armed_before = counter_total(armed_sidecar, "ipc_armed_chunks")
    with SidecarClient(armed_sidecar.address, ipc_armed=True) as client:
        stream = client.open_stream("ahead")
        first = stream.decode(codes[:, :10].cuda())  # leaves its codes in the region's slot
        host = codes[:, 10:20].pin_memory()
        torch.cuda._sleep(busy)
        later = host.cuda(non_blocking=True)  # [Q, 10]: exists on the GPU only after the 50 ms
        future = stream.submit(later)  # leaves at once: the GPU is still busy, the codes not made yet
        second = future.result(timeout=30)
        torch.cuda.current_stream().synchronize()
        assert client.ipc_stats["ipc_armed"] == 2
    assert counter_total(armed_sidecar, "ipc_armed_chunks") - armed_before == 2
    torch.testing.assert_close(torch.cat([first.cpu(), second.cpu()]), full[: 20 * spf], rtol=0, atol=1e-4)


def test_codes_out_of_range_are_refused_on_the_gpu_and_the_seq_sent_again(armed_sidecar, golden_cases):
    codes, full = golden_cases["codes"][0], golden_cases["full"][0, 0]
    spf = full.numel() // codes.shape[1]
    with SidecarClient(armed_sidecar.address, ipc_armed=True) as client:
        stream = client.open_stream("bad-codes")
        first = stream.decode(codes[:, :8].cuda())
        bad = codes[:, 8:16].clone()
        bad[1, 3] = 5000  # outside the codebook: clamped and refused by the step, the device never faults
        with pytest.raises(cerr.InvalidArgument, match=r"out of range \[0, 64\) \(checked on the GPU"):
            stream.decode(bad.cuda())
        again = stream.decode(codes[:, 8:16].cuda())  # the same seq: the state was not touched
        assert client.ipc_stats["ipc_armed"] == 3
    torch.testing.assert_close(torch.cat([first.cpu(), again.cpu()]), full[: 16 * spf], rtol=0, atol=1e-4)


def test_a_doorbell_rung_too_late_is_released_and_the_seq_sent_again(armed_sidecar, golden_cases):
    """The codes come 1 s after the message (past ``armed_wait_s``): the sidecar releases the wait, the chunk fails
    with ``DeadlineExceeded`` naming the doorbell, a stream of another client queued behind the parked step is
    served once it is released, and once the codes are there the same seq decodes as if nothing happened (by its
    event: the sidecar disarmed the region)."""
    codes, full = golden_cases["codes"][0], golden_cases["full"][0, 0]
    spf = full.numel() // codes.shape[1]
    released_before = counter_total(armed_sidecar, "ipc_armed_released")
    with SidecarClient(armed_sidecar.address, ipc_armed=True) as client, SidecarClient(armed_sidecar.address) as other:
        stream, bystander = client.open_stream("late"), other.open_stream("bystander")
        first = stream.decode(codes[:, :6].cuda())
        host = codes[:, 6:12].pin_memory()
        torch.cuda._sleep(_sleep_cycles(1000.0))
        future = stream.submit(host.cuda(non_blocking=True))
        by = bystander.decode(codes[:, :6])  # inline: queued behind the armed step, served once it is released
        with pytest.raises(cerr.DeadlineExceeded, match="were not ready"):
            future.result(timeout=30)
        torch.cuda.current_stream().synchronize()  # the late codes and their doorbell landed
        again = stream.decode(codes[:, 6:12].cuda())
    torch.testing.assert_close(by, full[: 6 * spf], rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.cat([first.cpu(), again.cpu()]), full[: 12 * spf], rtol=0, atol=1e-4)
    assert counter_total(armed_sidecar, "ipc_armed_released") - released_before == 1


def test_a_resend_is_answered_while_a_step_is_parked_on_a_doorbell(armed_sidecar, golden_cases):
    """While one client's armed step is parked on the GPU (its codes come 1 s late), another client resends its last
    chunk, whose audio went into its region: the sidecar answers from the host copy it kept, on the loop thread,
    without a device read (queued behind the parked wait, that read would block the loop, and with it the watchdog
    that releases the wait: the late codes would then be rung before any release and decoded). So the resend gets
    its audio, and the parked chunk is still released on time and fails ``DeadlineExceeded``."""
    codes, full = golden_cases["codes"][1], golden_cases["full"][1, 0]  # [Q, T], [T * U]
    spf = full.numel() // codes.shape[1]
    with SidecarClient(armed_sidecar.address) as other, SidecarClient(armed_sidecar.address, ipc_armed=True) as client:
        resent = other.open_stream("resent")
        first = resent.decode(codes[:, :6].cuda()).cpu()  # IPC both ways: the sidecar keeps its audio for a resend
        stream = client.open_stream("parks")
        stream.decode(codes[:, :6].cuda())
        host = codes[:, 6:12].pin_memory()
        talker = torch.cuda.Stream()  # the late codes' stream: the default one stays free for the resend's audio
        with torch.cuda.stream(talker):
            torch.cuda._sleep(_sleep_cycles(1000.0))
            future = stream.submit(host.cuda(non_blocking=True))
        time.sleep(0.05)  # the armed step is queued and parked on its doorbell now
        again = resent.resend().cpu()
        with pytest.raises(cerr.DeadlineExceeded, match="were not ready"):
            future.result(timeout=30)
        talker.synchronize()
    assert torch.equal(again, first)
    torch.testing.assert_close(first, full[: 6 * spf], rtol=0, atol=1e-4)


_DYING_CLIENT = textwrap.dedent("""
    import sys, torch
    from code2wav.client import SidecarClient
    client = SidecarClient(sys.argv[1], ipc_armed=True)
    stream = client.open_stream("dies-armed")
    codes = torch.randint(0, 64, (client.models[0].channels, 8)).pin_memory()
    stream.decode(codes.cuda())  # registers the regions; then a chunk whose codes wait behind 60 s of work
    torch.cuda._sleep(int(sys.argv[2]))
    future = stream.submit(codes.cuda(non_blocking=True))
    print("armed", flush=True)
    future.result()
""")


def test_a_client_that_dies_armed_leaves_every_other_stream_served(armed_sidecar, golden_cases):
    codes, full = golden_cases["codes"][1], golden_cases["full"][1, 0]
    spf = full.numel() // codes.shape[1]
    released_before = counter_total(armed_sidecar, "ipc_armed_released")
    child = subprocess.Popen([sys.executable, "-c", _DYING_CLIENT, armed_sidecar.address,
                              str(_sleep_cycles(60_000.0))], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "armed"
        time.sleep(0.1)  # the message is on its way (well within armed_wait_s): the sidecar's step waits for it
        child.kill()  # its GPU work dies with it: the doorbell is never written
        child.wait(timeout=30)
        with SidecarClient(armed_sidecar.address, ipc_armed=True) as client:
            stream = client.open_stream("survivor")
            outs = [stream.decode(codes[:, a:b].cuda()).cpu() for a, b in ((0, 5), (5, 20), (20, 30))]
    finally:
        if child.poll() is None:
            child.kill()
    torch.testing.assert_close(torch.cat(outs), full[: 30 * spf], rtol=0, atol=1e-4)
    assert counter_total(armed_sidecar, "ipc_armed_released") - released_before == 1
    assert armed_sidecar.proc.poll() is None  # still serving
