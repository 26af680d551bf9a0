"""The delegate's core: map runner steps onto sidecar streams (no vLLM import).

``Code2WavDelegate.decode_step(requests)`` takes one runner step (``step.parse_step``) and returns one float32
CPU waveform per request, in batch order, after ONE ``decode`` round trip to the sidecar (plus one pipelined
``open`` round trip in steps where requests start). Rules:

- A request's stream is keyed by its scheduler id (v1 runner) or else ``meta.request_id``; both ids are aliases.
- First chunk of a stream: its ``left_context_size`` frames (voice-clone reference codes) are sent as context
  frames: decoded into the stream's state, no audio for them. Later chunks carry only new frames in vLLM-Omni
  0.30 (``left_context_size=0``); if a later chunk repeats frames as left context, they are dropped (the sidecar
  already has them).
- ``finished`` / ``is_segment_finished``: the chunk goes as ``final`` (an empty one too), which frees the stream
  in the same round trip. A request without any id can only be a one-shot (full payload): it gets a stream of
  its own, sent final.
- ``on_requests_finished(ids)`` (scheduler ids under both runners): aborts the matching streams, by alias or by
  vLLM's ``<external id>-<8 hex>`` scheme; anything missed is forgotten after ``idle_ttl_s`` and, last, reaped
  by the sidecar's TTL.
- Window mode: a payload longer than ``window_chunk_frames`` is sent as several chunks of that size (the sidecar
  keeps ``left_context_frames`` between them), which is upstream's ``chunked_decode``.
- Dummy/profile requests are answered with silence here, and so is every request while a CUDA stream capture is
  active: nothing is sent then.
- Errors: a chunk the sidecar rejects (bad input, stream lost after a sidecar restart, busy) ends that
  request's audio (logged; later chunks of it get empty audio) while the other requests go on. A sidecar that
  does not answer at all raises ``SidecarUnavailableError``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..pool import SidecarPool
from ..errors import DeadlineExceeded, SidecarError, Unavailable
from ..stream import Stream
from .settings import DelegateSettings
from .step import StepRequest

__all__ = ["Code2WavDelegate", "SidecarUnavailableError", "cuda_stream_capturing"]

log = logging.getLogger(__name__)

_FORGET_AFTER_S = 600.0
_MAX_REMEMBERED = 4096
_SWEEP_EVERY_S = 30.0


class SidecarUnavailableError(RuntimeError):
    """The code2wav sidecar cannot be reached (start-up) or stopped answering (a step)."""


def cuda_stream_capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (then nothing may block or call out)."""
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:  # a torch without CUDA support
        return False


@dataclass(eq=False)
class _Entry:
    """One request's sidecar stream, as the delegate tracks it."""

    key: str
    aliases: set[str]
    stream_id: str
    stream: Stream | None = None
    sent_chunks: int = 0
    last_used_s: float = field(default_factory=time.monotonic)


@dataclass
class _Planned:
    request: StepRequest
    entry: _Entry
    pieces: list[tuple[torch.Tensor, dict[str, Any]]]
    final: bool


class Code2WavDelegate:
    """Per-process state of the delegate stage: one ``SidecarPool`` (one sidecar, several, or a DNS name's; each
    request's stream stays on the sidecar that opened it) and the open streams of its requests."""

    def __init__(self, settings: DelegateSettings, *, client_id: str | None = None,
                 client_factory: Callable[..., SidecarPool] = SidecarPool) -> None:
        self.settings = settings
        try:
            with torch.device("cpu"):  # the client makes CPU tensors, whatever default device vLLM set
                self.client = client_factory(settings.address, client_id=client_id, **settings.client_options)
        except SidecarError as exc:
            raise SidecarUnavailableError(
                f"the vLLM-Omni Code2Wav stage cannot reach the code2wav sidecar at {settings.address}: {exc}. "
                "Start it first (`code2wav-sidecar serve --address ADDRESS --model .../speech_tokenizer`) and "
                "point the stage at it with `sidecar_address` in the stage connector's `extra` (see "
                "deploy/vllm-omni/qwen3_tts_sidecar.yaml) or $CODE2WAV_SIDECAR_ADDRESS") from exc
        models = {m.name: m for m in self.client.models}
        if settings.model is not None and settings.model not in models:
            self.client.close()
            raise ValueError(f"sidecar_model={settings.model!r} is not served by the sidecar at {settings.address} "
                             f"(it serves {sorted(models)})")
        info = models[settings.model] if settings.model is not None else self.client.models[0]
        self.model_name: str = info.name
        self.num_quantizers: int = int(info.num_quantizers)
        self.samples_per_frame: int = int(info.samples_per_frame)
        self.sample_rate: int = int(info.sample_rate)
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._by_alias: dict[str, _Entry] = {}
        self._dropped: OrderedDict[str, float] = OrderedDict()  # ids whose audio was cut (abort, error)
        self._counter = 0
        self._last_sweep_s = time.monotonic()
        self._warned: set[str] = set()
        self.stats = {"steps": 0, "round_trips": 0, "chunks": 0, "opened": 0, "aborted": 0, "dummy": 0}

    # ------------------------------------------------------------------ public

    @property
    def open_requests(self) -> list[str]:
        """Keys of the requests that have a stream right now."""
        with self._lock:
            return sorted(self._entries)

    def silence(self, num_frames: int) -> torch.Tensor:
        return torch.zeros(max(0, num_frames) * self.samples_per_frame, dtype=torch.float32)

    def decode_step(self, requests: Sequence[StepRequest]) -> list[torch.Tensor]:
        """One runner step: float32 CPU waveforms ``[new frames * U]``, one per request, in order."""
        empty = torch.zeros(0, dtype=torch.float32)
        outputs: list[torch.Tensor] = [empty] * len(requests)
        if cuda_stream_capturing():  # vLLM capturing a graph around us: answer locally, never call out
            return [self.silence(r.num_frames) for r in requests]
        with self._lock:
            self.stats["steps"] += 1
            self._maybe_sweep()
            planned: list[_Planned] = []
            for request in requests:
                if request.dummy:
                    self.stats["dummy"] += 1
                    outputs[request.index] = self.silence(request.num_frames)
                    continue
                plan = self._plan(request)
                if plan is not None:
                    planned.append(plan)
            if not planned:
                return outputs
            self._open_new([p for p in planned if p.entry.stream is None])
            planned = [p for p in planned if p.entry.stream is not None and self._usable(p.entry)]
            if not planned:
                return outputs
            results = self._decode([(p.entry.stream, *piece) for p in planned for piece in p.pieces])
            position = 0
            for plan in planned:
                pieces = results[position:position + len(plan.pieces)]
                position += len(plan.pieces)
                errors = [r for r in pieces if isinstance(r, BaseException)]
                plan.entry.sent_chunks += len(plan.pieces)
                plan.entry.last_used_s = time.monotonic()
                if errors:
                    self._fail(plan.entry, errors[0])
                    continue
                audio = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                outputs[plan.request.index] = audio.reshape(-1).to(torch.float32)
                if plan.final:
                    self._forget(plan.entry)
            return outputs

    def on_requests_finished(self, finished_req_ids: Any) -> None:
        """Free the streams of finished or aborted requests (scheduler ids, or meta ids)."""
        if not finished_req_ids or cuda_stream_capturing():
            return
        aborts: list[Future[Any]] = []
        with self._lock:
            for req_id in list(finished_req_ids):
                entry = self._lookup_finished(str(req_id))
                if entry is None:
                    continue
                self._forget(entry, dropped=True)
                if entry.stream is not None and not entry.stream.closed and not entry.stream.lost:
                    self.stats["aborted"] += 1
                    aborts.append(self._submit_abort(entry.stream))
        for future in aborts:
            try:
                future.result(self.settings.timeout_s + 1.0)
            except Exception as exc:  # best effort: the sidecar's TTL frees what we could not
                log.warning("code2wav sidecar: abort failed (%s); the sidecar's TTL will free the stream", exc)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_alias.clear()
        self.client.close()  # says bye: the sidecar frees this client's streams

    # ------------------------------------------------------------------ planning

    def _plan(self, request: StepRequest) -> _Planned | None:
        final = request.finished or request.segment_finished
        ids = [i for i in (request.scheduler_id, request.request_id) if i]
        if request.codes is None:
            self._warn_once(f"malformed:{request.raw_length}",
                            "code2wav sidecar: a payload of %d codes is not a multiple of num_quantizers=%d; "
                            "request %s skipped", request.raw_length, self.num_quantizers, ids)
            codes = torch.zeros((self.num_quantizers, 0), dtype=torch.long)
        else:
            codes = request.codes
        entry = next((self._by_alias[i] for i in ids if i in self._by_alias), None)
        if entry is None:
            if any(i in self._dropped for i in ids):  # its audio was cut (abort or error): no restart midway
                if final:
                    for i in ids:
                        self._dropped.pop(i, None)
                return None
            if codes.shape[1] == 0:
                return None  # nothing to decode and nothing open: nothing to free
            if not ids:
                if not final:
                    self._warn_once("no-id", "code2wav sidecar: a request without request_id that is not "
                                    "finished; decoding it as a one-shot")
                final = True
            entry = self._new_entry(ids)
        first = entry.sent_chunks == 0
        context = 0
        if first:
            context = min(request.left_context, int(codes.shape[1]))
            if request.left_context > codes.shape[1]:
                self._warn_once("short-first", "code2wav sidecar: first chunk of %s has %d frames but declares "
                                "%d frames of left context", entry.key, codes.shape[1], request.left_context)
        elif request.left_context > 0:  # frames the stream already has
            codes = codes[:, request.left_context:]
        for alias in ids:
            if alias not in entry.aliases:
                entry.aliases.add(alias)
                self._by_alias[alias] = entry
        if codes.shape[1] == 0 and not final:
            return None
        return _Planned(request, entry, self._pieces(codes, context, final), final)

    def _pieces(self, codes: torch.Tensor, context: int, final: bool) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        limit = int(self.client.limits.max_chunk_frames)
        if self.settings.mode == "window":
            limit = min(limit, self.settings.window_chunk_frames)
        total = int(codes.shape[1])
        pieces: list[tuple[torch.Tensor, dict[str, Any]]] = []
        start = 0
        while True:
            end = min(total, start + limit)
            piece_context = max(0, min(context - start, end - start))
            last = end >= total
            options = {"final": final and last, "context_frames": piece_context}
            pieces.append((codes[:, start:end].contiguous(), options))
            if last:
                return pieces
            start = end

    def _new_entry(self, ids: list[str]) -> _Entry:
        self._counter += 1
        key = ids[0] if ids else f"one-shot-{self._counter}"
        max_len = int(self.client.limits.max_id_len)
        stream_id = f"{self._counter:x}/{key}".encode()[:max_len].decode(errors="ignore")
        entry = _Entry(key=key, aliases=set(ids), stream_id=stream_id)
        self._entries[f"{key}#{self._counter}"] = entry
        for alias in ids:
            self._by_alias[alias] = entry
        return entry

    # ------------------------------------------------------------------ sidecar calls

    def _open_new(self, planned: list[_Planned]) -> None:
        if not planned:
            return
        settings = self.settings
        futures = []
        for plan in planned:
            futures.append(self.client.submit_open_stream(
                plan.entry.stream_id, mode=settings.mode, left_context_frames=settings.left_context_frames,
                model=settings.model))
        self.stats["round_trips"] += 1
        for plan, future in zip(planned, futures):
            try:
                plan.entry.stream = future.result(settings.timeout_s + 1.0)
                self.stats["opened"] += 1
            except (Unavailable, DeadlineExceeded) as exc:
                raise SidecarUnavailableError(f"code2wav sidecar at {settings.address} did not answer: {exc}") from exc
            except SidecarError as exc:
                self._fail(plan.entry, exc)

    def _decode(self, items: list[tuple[Stream, torch.Tensor, dict[str, Any]]]) -> list[Any]:
        limit = int(self.client.limits.max_chunks_per_message)
        futures = [self.client.submit_batch(items[i:i + limit], return_exceptions=True)
                   for i in range(0, len(items), limit)]  # one message unless a step exceeds the server's limit
        self.stats["round_trips"] += 1
        self.stats["chunks"] += len(items)
        results: list[Any] = []
        for future in futures:
            try:
                results.extend(future.result(self.settings.timeout_s + 1.0))
            except concurrent.futures.TimeoutError as exc:
                raise SidecarUnavailableError(f"code2wav sidecar at {self.settings.address} did not answer a "
                                              f"decode of {len(items)} chunks in time") from exc
        fatal = [r for r in results if isinstance(r, (Unavailable, DeadlineExceeded))]
        if fatal:
            raise SidecarUnavailableError(f"code2wav sidecar at {self.settings.address} did not answer a decode of "
                                          f"{len(items)} chunks: {fatal[0]}") from fatal[0]
        return results

    def _submit_abort(self, stream: Stream) -> Future[Any]:
        return stream.submit_abort(timeout_s=self.settings.timeout_s)

    # ------------------------------------------------------------------ bookkeeping

    def _usable(self, entry: _Entry) -> bool:
        stream = entry.stream
        assert stream is not None
        try:
            stream.check_usable()  # a stream lost to a sidecar restart would fail the whole batch
        except SidecarError as exc:
            self._fail(entry, exc)
            return False
        return True

    def _fail(self, entry: _Entry, error: BaseException, *, quiet: bool = False) -> None:
        if not quiet:
            log.error("code2wav sidecar: request %s loses the rest of its audio: %s", entry.key, error)
        self._forget(entry, dropped=True)
        stream = entry.stream
        if stream is not None and not stream.closed and not stream.lost:
            try:
                self._submit_abort(stream)  # not awaited: the reply only confirms
            except SidecarError:
                pass

    def _forget(self, entry: _Entry, *, dropped: bool = False) -> None:
        for name, value in list(self._entries.items()):
            if value is entry:
                del self._entries[name]
        for alias in entry.aliases:
            if self._by_alias.get(alias) is entry:
                del self._by_alias[alias]
            if dropped:
                self._dropped[alias] = time.monotonic()
                self._dropped.move_to_end(alias)
        while len(self._dropped) > _MAX_REMEMBERED:
            self._dropped.popitem(last=False)

    def _lookup_finished(self, req_id: str) -> _Entry | None:
        entry = self._by_alias.get(req_id)
        if entry is None:
            base, sep, suffix = req_id.rpartition("-")  # vLLM's internal id: f"{external id}-{8 hex}"
            if sep and len(suffix) == 8:
                entry = self._by_alias.get(base)
        return entry

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep_s < _SWEEP_EVERY_S:
            return
        self._last_sweep_s = now
        while self._dropped and now - next(iter(self._dropped.values())) > _FORGET_AFTER_S:
            self._dropped.popitem(last=False)
        for entry in [e for e in self._entries.values() if now - e.last_used_s > self.settings.idle_ttl_s]:
            log.warning("code2wav sidecar: request %s idle for %.0fs without a finish; freeing its stream",
                        entry.key, now - entry.last_used_s)
            self._fail(entry, TimeoutError("idle"), quiet=True)

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)
