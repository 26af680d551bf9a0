"""A stream's kept reply (its last chunk's audio, for an idempotent resend) holds only its own samples (issue 22,
item 6). Streams of a vanished client keep it until the TTL; when each was a view of its batch's padded host
output ``[B, T * U]``, every such stream kept a whole batch alive and the sidecar's RSS grew with traffic."""

from __future__ import annotations

import torch

from code2wav.sidecar.engine import DecodeItem, Engine
from code2wav.sidecar.graphs.routine import rows_audio
from code2wav.sidecar.state_store import StateArena

TOL = 1e-5


def _owns_exactly(audio: torch.Tensor) -> bool:
    return audio.untyped_storage().nbytes() == audio.numel() * audio.element_size()


def test_batched_chunks_keep_only_their_own_samples(tiny_model, golden_cases):
    arena = StateArena(tiny_model.module.state_layout(), 8, tiny_model.dtype, tiny_model.device)
    engine = Engine(tiny_model, arena)
    codes = golden_cases["codes"]  # [2, Q, T]
    full = golden_cases["full"][:, 0]  # [2, T * U]
    spf = tiny_model.samples_per_frame
    # rows of different lengths (padded to the longest) and stateless rows with skipped context frames
    lengths = [3, 17, 40, 9]
    stateful = [DecodeItem(codes=codes[b % 2, :, :n], slot=arena.allocate(), skip_frames=0)
                for b, n in enumerate(lengths)]
    stateless = [DecodeItem(codes=codes[b % 2, :, :n], slot=None, skip_frames=2) for b, n in enumerate(lengths)]
    for items in (stateful, stateless):
        audios = engine.decode(items)
        for b, (item, audio) in enumerate(zip(items, audios)):
            n = item.codes.shape[1]
            assert audio.numel() == (n - item.skip_frames) * spf
            assert _owns_exactly(audio), f"row {b} keeps {audio.untyped_storage().nbytes()} bytes for {audio.nbytes}"
            expected = full[b % 2, item.skip_frames * spf: n * spf]  # exact streaming: a prefix of the full decode
            assert (audio - expected).abs().max().item() <= TOL


def test_rows_audio_host_rows_are_compact_device_rows_are_views():
    wav = torch.arange(4 * 10 * 3, dtype=torch.float32).reshape(4, 30)  # [B, T * U], U = 3
    items = [DecodeItem(codes=torch.zeros(2, n, dtype=torch.long), slot=None, skip_frames=skip, out_device=dev)
             for n, skip, dev in ((10, 0, False), (4, 1, False), (7, 0, True), (10, 10, False))]
    rows = rows_audio(wav, items, 3)
    assert [r.numel() for r in rows] == [30, 9, 21, 0]
    for b, (row, item) in enumerate(zip(rows, items)):
        assert torch.equal(row, wav[b, item.skip_frames * 3: item.codes.shape[1] * 3])
        if item.out_device:  # consumed (written into a client region) before the next forward
            assert row.untyped_storage().data_ptr() == wav.untyped_storage().data_ptr()
        else:
            assert _owns_exactly(row)
            assert row.untyped_storage().data_ptr() != wav.untyped_storage().data_ptr()
