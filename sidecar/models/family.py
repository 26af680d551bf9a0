"""The decoder-family contract: what the rest of the sidecar may know about a codec/vocoder.

A ``DecoderFamily`` (one folder under ``models/``, e.g. ``qwen3_tts/``) recognises its checkpoint folders,
builds a module (from a folder, or ``default``: the shipped architecture with seeded random weights), and
describes it as a ``Contract``: the input kind (integer codes ``[B, Q, T]`` or float latents ``[B, D, T]``)
with its wire dtypes and valid range, the output rate and samples per frame, the per-stream state layout,
and the integer per-stream options a stream may set when it opens (validated here, fed per row to every
forward). ``LoadedModel`` is a loaded model with its contract; engine, sessions, modes, graphs, inputs and
offline read everything from it and never name a family.

The one streaming call every family implements is ``forward_stream(module, batch, state) -> (audio,
new_state)``: ``batch`` is a ``StreamBatch`` (inputs right-padded to a common length, valid frames per row,
frames each row decoded before, option values per row), ``state`` the rows' ``{name: [B, ...]}``; ``audio`` is
float32 ``[B, T * U]``, valid for ``num_frames[b] * U`` samples per row; ``new_state`` is each row's state after
its last valid frame. It must be capturable by a CUDA graph (no data-dependent Python branches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch
from torch import Tensor, nn

from code2wav.proto import FLOAT_DTYPES, WIRE_DTYPES

from .streaming import zero_state

INPUT_KINDS = ("codes", "latents")
_INTEGER_WIRE_DTYPES = tuple(d.name for d in WIRE_DTYPES if d.is_integer)  # any integer wire dtype, staged as int64
_FLOAT_WIRE_DTYPES = ("float32", "bfloat16")  # of proto.FLOAT_DTYPES, these (in this order: the welcome lists it);
# staged in the model's dtype either way
assert set(_FLOAT_WIRE_DTYPES) <= FLOAT_DTYPES


class FamilyError(ValueError):
    """A model folder or option no family accepts; the message says what to change."""


class CheckpointError(FamilyError):
    """A checkpoint folder whose files do not hold the family's model (missing, unexpected or misshapen tensors, a
    bad config); the message names what to fix. Every family's loader raises this one class."""


LATENT_ABS_MAX = 1e4
"""Latents beyond this magnitude are refused (proto/README.md, section 4): it keeps every decoder finite in float32
and bfloat16 with a wide margin. Measured on the VoxCPM2 tiny and full-size (seeded) decoders: the state grows at
most ~12x the input and the audio is bounded; inputs up to 1e30 stay finite in both dtypes, 1e38 gives NaN
(tests/test_poisoned_stream.py). Real latents are O(1). (A float16 model can still overflow within the bound: the
engine's finite check then refuses the chunk and keeps the stream's state.)"""


@dataclass(frozen=True)
class InputSpec:
    """What one chunk's inputs are: ``[channels, n]`` per chunk, ``[B, channels, T]`` per batch.

    ``codes``: integers in ``[0, high)`` (``high`` is the codebook size), staged as int64.
    ``latents``: finite floats of magnitude at most ``LATENT_ABS_MAX`` (``high`` 0), staged in the model's dtype."""

    kind: str  # "codes" | "latents"
    channels: int  # Q quantizers or D latent channels
    high: int = 0  # codes: exclusive upper bound (the codebook size); latents: 0

    def __post_init__(self) -> None:
        if self.kind not in INPUT_KINDS:
            raise ValueError(f"input kind must be one of {INPUT_KINDS}, got {self.kind!r}")
        if self.channels < 1 or (self.kind == "codes") != (self.high >= 1):
            raise ValueError(f"bad input spec {self}: codes need high >= 1 (codebook size), latents high == 0")

    @property
    def is_integer(self) -> bool:
        return self.kind == "codes"

    @property
    def wire_dtypes(self) -> tuple[str, ...]:
        """Dtypes a client may send the inputs in."""
        return _INTEGER_WIRE_DTYPES if self.is_integer else _FLOAT_WIRE_DTYPES

    @property
    def valid_range(self) -> tuple[int, int] | None:
        """``[low, high)`` for codes; None for latents (any finite value)."""
        return (0, self.high) if self.is_integer else None

    def staged_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype inputs have on the device: int64 codes, latents in the model's dtype."""
        return torch.long if self.is_integer else model_dtype

    def host_dtype(self) -> torch.dtype:
        """The dtype checked inputs have on the host (int64 codes, float32 latents)."""
        return torch.long if self.is_integer else torch.float32

    def check_rows(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        """The device-side check of a staged batch ``[B, C, T]`` (padding is zero, which is valid): ``(inputs safe to
        hand to the decoder, [B] bool: the row's inputs are valid)``, as ``problem`` says. Codes are clamped into
        the codebook (an index outside it would fault the device for every stream); latents are passed as they are
        (a bad value makes no kernel fault; its row is refused). Graph-capturable: no host reads. Inputs read from a
        CUDA IPC region are checked only here; inline ones were checked on arrival and pass."""
        if self.is_integer:
            safe = inputs.clamp(0, self.high - 1)  # [B, C, T]
            return safe, (safe == inputs).flatten(1).all(dim=1)  # [B]
        return inputs, (inputs.abs() <= LATENT_ABS_MAX).flatten(1).all(dim=1)  # [B]: NaN compares False

    def device_problem(self) -> str:
        """What a row refused by ``check_rows`` held (the device keeps no value to quote)."""
        if self.is_integer:
            return f"a code out of range [0, {self.high}) (checked on the GPU: the codes came from a CUDA IPC region)"
        return (f"a latent that is not finite or of magnitude beyond {LATENT_ABS_MAX:g} (checked on the GPU: the "
                "latents came from a CUDA IPC region)")

    def problem(self, values: Tensor) -> str | None:
        """Why ``values`` (any shape, host or device) are not valid inputs, or None. One reduction per call."""
        if values.numel() == 0:
            return None
        if self.is_integer:
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= self.high:
                bad = low if low < 0 else high
                return f"code {bad} out of range [0, {self.high})"
            return None
        peak = float(values.abs().amax())  # NaN for any NaN, inf for any inf
        if not math.isfinite(peak):
            return (f"latents hold a non-finite value (NaN or inf); expected finite floats of shape "
                    f"[{self.channels}, n] per chunk")
        if peak > LATENT_ABS_MAX:
            return (f"latents hold a value of magnitude {peak:.3g}, beyond the bound {LATENT_ABS_MAX:g} that keeps "
                    "the decoder finite (proto/README.md, section 4)")
        return None


@dataclass(frozen=True)
class StreamOption:
    """An integer a stream sets when it opens (e.g. a sample-rate condition), one value per row of every forward."""

    name: str
    low: int  # inclusive
    high: int  # inclusive
    default: int
    doc: str = ""

    def check(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not self.low <= value <= self.high:
            raise FamilyError(f"stream option '{self.name}' must be an integer in [{self.low}, {self.high}], "
                              f"got {value!r}")
        return value


@dataclass(frozen=True)
class StateSpec:
    shape: tuple[int, ...]  # per row
    dtype: torch.dtype | None = None  # None: the model's dtype (the arena stores one dtype for all entries)


def state_specs(layout: Mapping[str, tuple[int, ...]]) -> dict[str, StateSpec]:
    """``Contract.state`` from a module's state layout (``streaming.assign_state_keys``): each entry per row, in the
    model's dtype."""
    return {name: StateSpec(tuple(shape)) for name, shape in layout.items()}


@dataclass(frozen=True)
class GraphBuckets:
    """A family's default CUDA-graph buckets: the chunk shapes its clients send (``graphs.*`` in the config
    overrides each field). Exact mode: ``(batch, new_frames)``; window mode: ``(batch, context + new frames)``."""

    exact_batch_sizes: tuple[int, ...]
    exact_frames: tuple[int, ...]
    window_batch_sizes: tuple[int, ...]
    window_frames: tuple[int, ...]


@dataclass(frozen=True)
class Contract:
    """Everything about a model that code outside its family folder may use."""

    input: InputSpec
    sample_rate_hz: int
    samples_per_frame: int
    state: Mapping[str, StateSpec]
    stream_options: tuple[StreamOption, ...] = ()
    history_frames: int = 0
    """``H``: the recent input frames that determine an exact stream's state (``streaming/reach.py``); replaying them
    into a fresh stream rebuilds it (a client pool's failover). 0: not declared (no exact failover)."""

    def check_options(self, given: Mapping[str, Any] | None) -> dict[str, int]:
        """A stream's option values: every option, the given ones validated, the rest at their default."""
        given = dict(given or {})
        known = {opt.name: opt for opt in self.stream_options}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise FamilyError(f"unknown stream option(s) {unknown}; this model takes {sorted(known) or 'none'}")
        return {name: opt.check(given[name]) if name in given else opt.default for name, opt in known.items()}


@dataclass(frozen=True)
class StreamBatch:
    """One batched forward's inputs (all on the model's device)."""

    inputs: Tensor  # [B, C, T] int64 codes or float latents, right-padded
    num_frames: Tensor  # [B] valid frames per row
    positions: Tensor  # [B] frames each row's stream decoded before
    options: dict[str, Tensor] = field(default_factory=dict)  # name -> [B] int64
    audio: bool = True  # False: no row's audio is kept (every frame is context: a history replay), so a family may
    # skip work that only makes audio; the new state must be the same (within float rounding)


class DecoderFamily(Protocol):
    """One codec/vocoder family. Methods take the family's own module; nothing else calls into the module."""

    name: str  # e.g. "qwen3_tts": advertised in the welcome message
    default_model_name: str  # the served model name when the config gives none
    graph_buckets: GraphBuckets  # default graph buckets: the chunk shapes this family's clients send

    def recognises(self, config: Mapping[str, Any]) -> bool:
        """Whether a folder's parsed ``config.json`` is one of this family's (by its keys)."""
        ...

    def load(self, folder: Path) -> tuple[nn.Module, Contract]:
        """Strictly load a checkpoint folder (float32, CPU); errors name what to fix."""
        ...

    def default(self, seed: int) -> tuple[nn.Module, Contract]:
        """The shipped architecture with seeded random weights (float32, CPU)."""
        ...

    def forward_stream(self, module: nn.Module, batch: StreamBatch,
                       state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        ...

    def forward(self, module: nn.Module, inputs: Tensor) -> Tensor:
        """One-shot decode: ``[B, C, T]`` -> ``[B, 1, T * U]`` float32."""
        ...

    def use_fused_kernels(self, module: nn.Module, enabled: bool) -> bool:
        """Switch the module's hand-written device kernels (``sidecar/kernels/``) on or off; returns whether any
        are in use (False for a family that has none, or without Triton). Called once after the module moved
        to its device; graphs capture whichever is on then."""
        ...


@dataclass
class LoadedModel:
    """A loaded model and its contract: the one place engine, sessions, graphs and offline read from."""

    name: str
    family: DecoderFamily
    module: nn.Module
    contract: Contract
    device: torch.device
    dtype: torch.dtype
    source: str  # "random-weights" or the folder
    fused_kernels: bool = False  # the family's Triton kernels are in use (``DecoderFamily.use_fused_kernels``)

    @property
    def family_name(self) -> str:
        return self.family.name

    @property
    def input(self) -> InputSpec:
        return self.contract.input

    @property
    def samples_per_frame(self) -> int:
        return self.contract.samples_per_frame

    @property
    def sample_rate_hz(self) -> int:
        return self.contract.sample_rate_hz

    @property
    def num_channels(self) -> int:
        """Q (codes) or D (latents): the first dimension of a chunk's inputs."""
        return self.contract.input.channels

    @property
    def num_quantizers(self) -> int:  # the wire's name for the channel count (kept for clients and loadgen)
        return self.contract.input.channels

    @property
    def codebook_size(self) -> int:
        """The codes' exclusive upper bound; 0 for latents."""
        return self.contract.input.high

    def state_layout(self) -> dict[str, tuple[int, ...]]:
        """Per-row state shapes for the arena (which stores them in one dtype, checked at load)."""
        return {name: spec.shape for name, spec in self.contract.state.items()}

    def zero_state(self, batch: int) -> dict[str, Tensor]:
        """A fresh stream's state for ``batch`` rows, in the model's dtype (the registry refuses any other)."""
        return zero_state(self.state_layout(), batch, self.dtype, self.device)

    def zero_options(self, batch: int) -> dict[str, Tensor]:
        """Every option at its default for ``batch`` rows."""
        return {opt.name: torch.full((batch,), opt.default, dtype=torch.long, device=self.device)
                for opt in self.contract.stream_options}

    def forward_stream(self, batch: StreamBatch, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        return self.family.forward_stream(self.module, batch, state)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.family.forward(self.module, inputs)
