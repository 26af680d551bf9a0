"""The server's ``welcome`` and the model entries it carries, each declared once (see ``declare.py``).

Rules: sans-IO; stdlib only; never imports zmq, torch or numpy; imports nothing outside ``proto``. Server ->
client maps are parsed leniently: unknown keys are ignored (a newer server may add fields); the fields this
version knows are checked. The contract fields of a model entry default to a codes model's values, for servers
that predate them.
"""

from __future__ import annotations

from typing import Any

from .declare import message, record, wire
from .dtypes import WIRE_DTYPES
from .limits import DEFAULT_LIMITS, Limits
from .load import Load
from ._check import INT64_MAX
from .wire_containers import AnyMap, ArrayOf, IntPair, Nullable
from .wire_types import UINT64, CountOrNone, Int, PositiveFloat, Str

__all__ = ["StreamOptionInfo", "ModelInfo", "Welcome"]

MAX_MODELS = 256
MAX_MODEL_LIST = 16  # modes, input dtypes, stream options of one model
_ANY_INT = Int(-INT64_MAX, INT64_MAX)


@record("stream option", sender="server")
class StreamOptionInfo:
    """An integer option a stream of this model may set in ``open_stream.options`` (range inclusive)."""

    name: str = wire(Str(), doc="the option's name in `open_stream.options`, e.g. `sr_cond`")
    low: int = wire(_ANY_INT, doc="the lowest value allowed")
    high: int = wire(_ANY_INT, doc="the highest value allowed")
    default: int = wire(_ANY_INT, doc="the value of a stream that does not set it")


@record("model", sender="server")
class ModelInfo:
    """A served model and its input contract (proto/README.md, "welcome"), for either input kind:

    - ``input_kind``: ``codes`` (integers ``[Q, n]``, e.g. Qwen3-TTS) or ``latents`` (floats ``[D, n]``, e.g.
      VoxCPM2's AudioVAE); ``channels``: ``Q`` or ``D`` (``num_quantizers`` is the same number, for either kind);
    - ``input_dtypes``: the dtypes a chunk may travel in; ``valid_range``: ``[low, high)`` of codes, None for
      latents; ``codebook_size``: the codes' codebook size, None for latents (0 on the wire);
    - ``frame_rate_hz`` (input frames per second), ``samples_per_frame`` (``U``) and ``sample_rate`` (audio Hz).

    The contract fields default to a codes model's values for servers that do not send them."""

    name: str = wire(Str(), doc="what `open_stream.model` names")
    num_quantizers: int = wire(Int(1), doc="`Q`: the inputs' first dimension, also for latents")
    codebook_size: int | None = wire(CountOrNone(), doc="codes take values in `[0, codebook_size)`; 0 for latents "
                                                        "(no codebook: the Python client reads `None`)")
    samples_per_frame: int = wire(Int(1), doc="`U`, e.g. 1920 for 12.5 Hz codes at 24 kHz")
    sample_rate: int = wire(Int(1), doc="of the audio, in Hz")
    modes: tuple[str, ...] = wire(ArrayOf(Str(), MAX_MODEL_LIST), doc="the stream modes it offers (section 5)")
    dtype: str = wire(Str(), doc="its compute dtype")
    device: str = wire(Str(), doc="e.g. `cuda:0`, `cpu`")
    family: str = wire(Str(empty=True), default="", doc="the decoder family, e.g. `qwen3_tts`, `voxcpm2_audiovae`")
    input_kind: str = wire(Str(), default="codes",
                           doc="`codes` (integers `[Q, n]`) or `latents` (finite floats `[D, n]`)")
    input_dtypes: tuple[str, ...] = wire(
        ArrayOf(Str(), MAX_MODEL_LIST), default=tuple(dtype.name for dtype in WIRE_DTYPES if dtype.is_integer),
        doc="the chunk dtypes it accepts, e.g. `[\"float32\",\"bfloat16\"]` for latents")
    input_channels: int = wire(Int(0), default=0, doc="`Q` or `D`: a chunk's first dimension (0: `num_quantizers`)")
    input_range: tuple[int, int] | None = wire(
        Nullable(IntPair()), default=None,
        doc="codes: valid values `low <= v < high` (nil: `[0, codebook_size)`); ignored for latents (any finite "
            "value)")
    stream_options: tuple[StreamOptionInfo, ...] = wire(
        ArrayOf(StreamOptionInfo, MAX_MODEL_LIST), default=(),
        doc="what `open_stream.options` may set (stream option table below)")
    history_frames: int = wire(
        Int(0), default=0, omit_default=True,
        doc="`H`: the last `H` input frames of an `exact` stream determine its state; replaying them into a "
            "fresh stream rebuilds it (section 11). 0 or absent: not declared")

    @property
    def channels(self) -> int:
        """A chunk's first dimension: ``Q`` codebooks of codes or ``D`` latent channels."""
        return self.input_channels or self.num_quantizers

    @property
    def frame_rate_hz(self) -> float:
        """Input frames per second (12.5 for Qwen3-TTS codes, 25 for VoxCPM2 latents)."""
        return self.sample_rate / self.samples_per_frame

    @property
    def inputs_text(self) -> str:
        """The inputs in the family's own words, for messages: e.g. ``codes [16, n] (int16/int32/int64, values in
        [0, 2048))`` or ``latents [64, n] (float32/bfloat16, finite)``."""
        valid_range = self.valid_range
        values = "finite" if valid_range is None else f"values in [{valid_range[0]}, {valid_range[1]})"
        return f"{self.input_kind} [{self.channels}, n] ({'/'.join(self.input_dtypes)}, {values})"

    @property
    def valid_range(self) -> tuple[int, int] | None:
        if self.input_kind != "codes":
            return None
        return self.input_range or (0, self.codebook_size)


@message("welcome", sender="server")
class Welcome:
    """Reply to ``Hello``."""

    request_id: int = wire(UINT64, doc="the `hello`'s")
    version: int = wire(Int(0), doc="the server's protocol version (1)")
    server_id: str = wire(Str(), doc="e.g. the host name")
    boot_epoch: str = wire(Str(), doc="unique per server process start; see section 6")
    models: tuple[ModelInfo, ...] = wire(ArrayOf(ModelInfo, MAX_MODELS), doc="the served models (model table below)")
    default_model: str = wire(Str(), doc="the model used when `open_stream.model` is nil")
    limits: Limits = wire(Limits, default=DEFAULT_LIMITS, required=True,
                          doc="the server's limits (section 8); clients must stay within them")
    heartbeat_interval_s: float = wire(PositiveFloat(), default=0.5, required=True,
                                       doc="how often clients ping (section 6); the server's default is 0.5")
    capabilities: dict[str, Any] = wire(
        AnyMap(), default_factory=dict,
        doc="`cuda_ipc`: bool; with it, `gpu_uuid` (str) and `host_id` (str: the server's boot id; CUDA IPC needs "
            "the same host); `load`: int, the version of the load map it sends (section 10); `early_audio`: bool, "
            "`open_stream.early_audio` is understood (section 5)")
    session_secret: str | None = wire(
        Nullable(Str()), default=None, omit_default=True,
        doc="random per session: binds the session to this client; a later `hello` on this routing id presents it "
            "(section 1)")
    load: Load | None = wire(Nullable(Load), default=None, omit_default=True,
                             doc="the server's load when it answered (load map, section 10); nil or absent from a "
                                 "server that does not report it")

    def model(self, name: str | None) -> ModelInfo | None:
        """The model called ``name`` (the default model for ``None``), if served."""
        wanted = self.default_model if name is None else name
        for info in self.models:
            if info.name == wanted:
                return info
        return None
