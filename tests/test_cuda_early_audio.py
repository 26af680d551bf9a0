"""Early audio on a real GPU (skipped without one): the test process is the client, the sidecar a spawned ``serve``
process on the tiny golden model. A stream opened with ``early_audio`` has each CUDA IPC chunk answered at its step's
launch, its outcome read after (proto/README.md section 5).

What must hold: early audio equals the golden decode and a plain stream's audio bit for bit, whatever shares the
message; a chunk the step refuses after its early reply (a code outside the codebook, checked on the GPU) reads as
zeros, the stream's next call raises the chunk's error with ``failed_seq``, another client's stream is untouched,
and the refused seq sent again decodes as if nothing had happened; a refusal known before the reply leaves (a message
with other chunks) is told in it directly; a finish while the refusal stands is refused and the stream stays open."""

from __future__ import annotations

import pytest
import torch

from code2wav.client import SidecarClient
from code2wav.client import errors as cerr

from conftest import counter_total

pytestmark = pytest.mark.cuda


def test_early_audio_equals_the_golden_decode_and_a_plain_streams_bit_for_bit(gpu_sidecar, golden_cases):
    codes, full = golden_cases["codes"][1], golden_cases["full"][1, 0]  # [Q, T], [T * U]
    cuts = [0, 1, 4, 29, 30, codes.shape[1]]
    answered_before = counter_total(gpu_sidecar, "chunks_answered_early")
    with SidecarClient(gpu_sidecar.address) as client:
        assert client.server_info.capabilities["early_audio"] is True
        early, plain = client.open_stream("early", early_audio=True), client.open_stream("plain")
        outs = []
        for start, end in zip(cuts, cuts[1:]):
            final = end == codes.shape[1]
            a = early.decode(codes[:, start:end].cuda(), final=final)
            b = plain.decode(codes[:, start:end].cuda(), final=final)
            assert a.is_cuda and torch.equal(a.cpu(), b.cpu()), (start, end)  # .cpu(): on the caller's stream
            outs.append(a.cpu())
        torch.testing.assert_close(torch.cat(outs), full, rtol=0, atol=1e-4)
        # one message with an early stream and a plain one: each its own way, results in order
        early2, plain2 = client.open_stream("early-2", early_audio=True), client.open_stream("plain-2")
        a, b = client.decode_batch([(early2, codes[:, :7].cuda()), (plain2, codes[:, :7].cuda())])
        assert torch.equal(a.cpu(), b.cpu())
    # the early stream's chunks but its final one (early-2's reply waited for plain-2's chunk: not early)
    assert counter_total(gpu_sidecar, "chunks_answered_early") - answered_before == len(cuts) - 2


def test_a_chunk_refused_after_its_early_reply_reads_zeros_and_the_next_call_says_so(gpu_sidecar, golden_cases):
    codes, full = golden_cases["codes"][0], golden_cases["full"][0, 0]
    spf = full.numel() // codes.shape[1]
    answered_before = counter_total(gpu_sidecar, "chunks_answered_early")
    refused_before = counter_total(gpu_sidecar, "chunks_refused_after_early_audio")
    bad = codes[:, 8:16].clone()
    bad[1, 3] = 5000  # outside the codebook: clamped and refused by the step on the GPU
    with SidecarClient(gpu_sidecar.address) as client, SidecarClient(gpu_sidecar.address) as other:
        stream, bystander = client.open_stream("bad", early_audio=True), other.open_stream("bystander")
        first = stream.decode(codes[:, :8].cuda())
        by_first = bystander.decode(codes[:, :8].cuda())
        by_future = bystander.submit(codes[:, 8:16].cuda())  # another client's chunk, in the same step or not
        refused_audio = stream.decode(bad.cuda())  # answered at launch
        assert torch.count_nonzero(refused_audio.cpu()) == 0  # its slot: zeros, never garbage
        assert stream.next_seq == 2  # as far as the client knows, seq 1 was committed
        with pytest.raises(cerr.InvalidArgument, match=r"out of range \[0, 64\)") as info:
            stream.decode(codes[:, 16:24].cuda())
        assert info.value.failed_seq == 1 and "seq 1" in info.value.message and stream.next_seq == 1
        with pytest.raises(cerr.OutOfOrder, match="send seq 1 again first"):
            stream.decode(codes[:, 16:24].cuda())  # meant to follow seq 2: refused by the client, never sent as 1
        again = stream.decode(codes[:, 8:16].cuda(), seq=1)  # seq 1 again: the state was not touched
        # a message whose reply waits for another chunk: a refusal known before it leaves is told in it directly
        early2, plain = client.open_stream("bad-2", early_audio=True), client.open_stream("plain")
        results = client.decode_batch([(early2, bad.cuda()), (plain, codes[:, :8].cuda())], return_exceptions=True)
        assert isinstance(results[0], cerr.InvalidArgument) and results[0].failed_seq is None
        assert early2.next_seq == 0
        torch.testing.assert_close(results[1].cpu(), full[: 8 * spf], rtol=0, atol=1e-4)
        third = stream.decode(codes[:, 16:24].cuda())
        by_second = by_future.result(timeout=30)
        by_third = bystander.decode(codes[:, 16:24].cuda())
        audio = torch.cat([first.cpu(), again.cpu(), third.cpu()])
        by_audio = torch.cat([by_first.cpu(), by_second.cpu(), by_third.cpu()])
    torch.testing.assert_close(audio, full[: 24 * spf], rtol=0, atol=1e-4)
    torch.testing.assert_close(by_audio, full[: 24 * spf], rtol=0, atol=1e-4)
    assert counter_total(gpu_sidecar, "chunks_refused_after_early_audio") - refused_before == 1
    # first, bad, again, third (bad-2's reply waited for plain's chunk: its refusal told in it, not early)
    assert counter_total(gpu_sidecar, "chunks_answered_early") - answered_before == 4


def test_a_finish_while_a_late_refusal_stands_is_refused_and_the_stream_goes_on(gpu_sidecar, golden_cases):
    codes, full = golden_cases["codes"][1], golden_cases["full"][1, 0]
    spf = full.numel() // codes.shape[1]
    with SidecarClient(gpu_sidecar.address) as client:
        stream = client.open_stream("finish-after-refusal", early_audio=True)
        first = stream.decode(codes[:, :5].cuda())
        bad = codes[:, 5:10].clone()
        bad[0, 0] = 64  # just past the codebook
        stream.decode(bad.cuda())
        with pytest.raises(cerr.InvalidArgument) as info:
            stream.finish()
        assert info.value.failed_seq == 1 and not stream.closed and stream.next_seq == 1
        again = stream.decode(codes[:, 5:10].cuda(), seq=1)
        stream.finish()
        assert stream.closed
    torch.testing.assert_close(torch.cat([first.cpu(), again.cpu()]), full[: 10 * spf], rtol=0, atol=1e-4)
