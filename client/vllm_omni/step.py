"""Turn one vLLM-Omni runner step's inputs into per-request chunks (no vLLM import, no I/O).

What the runners hand the Code2Wav stage model's ``forward`` (vLLM-Omni 0.30):

- ``input_ids``: the flat token ids of every scheduled request, concatenated (possibly padded at the end);
  ``seq_token_counts`` says how many belong to each request, in batch order.
- ``runtime_additional_information`` (v1) / ``model_intermediate_buffer`` (v2; both names are passed): one dict
  per request. ``info["codes"]["audio"]``, when present, is the authoritative codebook-major ``[Q*F]`` payload
  (the ids are then only placeholders; an empty one is a finished request's last, empty chunk);
  ``info["meta"]`` has ``request_id`` (the external id), ``left_context_size``, ``finished``,
  ``is_segment_finished`` and ``ref_context_*`` (values may be plain, one-element lists or tensors).
- ``request_ids``: scheduler-side ids, only under the v1 runner (for models with ``requires_request_ids``).
- Dummy/profile runs: v1 passes ``get_dummy_runtime_additional_information(n)`` (our marker ids), v2 passes empty
  dicts; both pass synthetic ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["DUMMY_REQUEST_PREFIX", "StepRequest", "parse_step", "dummy_runtime_information"]

DUMMY_REQUEST_PREFIX = "__code2wav_sidecar_dummy_run__"


@dataclass
class StepRequest:
    """One request of one runner step."""

    index: int
    codes: torch.Tensor | None
    """``[Q, F]`` int64 on CPU; None when the payload is malformed (length not a multiple of Q)."""
    request_id: str | None = None
    """``meta.request_id``: the external id the connector uses."""
    scheduler_id: str | None = None
    """The runner's id (v1 only); ``on_requests_finished`` gets these under both runners."""
    left_context: int = 0
    finished: bool = False
    segment_finished: bool = False
    dummy: bool = False
    raw_length: int = 0

    @property
    def num_frames(self) -> int:
        return 0 if self.codes is None else int(self.codes.shape[1])


def dummy_runtime_information(num_reqs: int) -> list[dict[str, Any]]:
    """What ``get_dummy_runtime_additional_information`` returns: finished requests with marker ids."""
    return [{"meta": {"request_id": f"{DUMMY_REQUEST_PREFIX}{i}", "finished": True}} for i in range(max(0, num_reqs))]


def _first(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[0].item() if value.numel() else None
    return value


def _as_int(value: Any) -> int:
    value = _first(value)
    return int(value) if value is not None else 0


def _as_bool(value: Any) -> bool:
    return bool(_first(value))


def _as_str(value: Any) -> str | None:
    value = _first(value)
    return None if value is None else str(value)


def _native_codes(info: Any) -> torch.Tensor | None:
    """``info["codes"]["audio"]`` when present (an empty one too: a finished request's last, empty chunk)."""
    if not isinstance(info, dict):
        return None
    codes = info.get("codes")
    audio = codes.get("audio") if isinstance(codes, dict) else None
    if isinstance(audio, torch.Tensor):
        return audio.reshape(-1)
    if isinstance(audio, (list, tuple)):
        return torch.as_tensor(audio, dtype=torch.long).reshape(-1)
    return None


def parse_step(
    input_ids: torch.Tensor | None,
    infos: Sequence[Any] | None,
    seq_token_counts: Sequence[int] | None,
    request_ids: Sequence[Any] | None,
    num_quantizers: int,
) -> list[StepRequest]:
    """Split a runner step into ``StepRequest``s, in batch order (one per request the runner scheduled)."""
    infos = list(infos or [])
    ids = input_ids.reshape(-1) if input_ids is not None else torch.zeros(0, dtype=torch.long)
    if seq_token_counts is not None and len(seq_token_counts) > 0:
        counts = [int(c) for c in seq_token_counts]
    elif len(infos) <= 1:
        counts = [int(ids.numel())]
    else:  # no split given: only native payloads can be told apart
        counts = [0] * len(infos)
    ids_cpu: torch.Tensor | None = None
    out: list[StepRequest] = []
    start = 0
    for index, count in enumerate(counts):
        info = infos[index] if index < len(infos) else None
        meta = info.get("meta") if isinstance(info, dict) else None
        meta = meta if isinstance(meta, dict) else {}
        native = _native_codes(info)
        request_id = _as_str(meta.get("request_id"))
        scheduler_id = str(request_ids[index]) if request_ids is not None and index < len(request_ids) else None
        dummy = (request_id is not None and request_id.startswith(DUMMY_REQUEST_PREFIX)) or (
            not meta and native is None and scheduler_id is None)
        if dummy:  # synthetic ids: never read them (no device-to-host copy), only their count matters
            flat = torch.zeros(count - count % num_quantizers, dtype=torch.long)
        elif native is not None:
            flat = native.to(device="cpu", dtype=torch.long)
        else:
            if ids_cpu is None:
                ids_cpu = ids.to("cpu")  # one device-to-host copy per step, only when a request needs the ids
            flat = ids_cpu[start:min(start + count, ids_cpu.numel())].to(dtype=torch.long)
        start += count
        n = int(flat.numel())
        codes = flat.reshape(num_quantizers, n // num_quantizers) if n % num_quantizers == 0 else None
        out.append(StepRequest(
            index=index, codes=codes, request_id=request_id, scheduler_id=scheduler_id,
            left_context=max(0, _as_int(meta.get("left_context_size"))),
            finished=_as_bool(meta.get("finished")), segment_finished=_as_bool(meta.get("is_segment_finished")),
            dummy=dummy, raw_length=n))
    return out
