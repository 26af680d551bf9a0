"""Server configuration: typed, validated once at load; unknown keys are rejected by name with a hint.

Sources, later wins: defaults < ``--config FILE`` (YAML) < command-line flags.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from code2wav.proto.address import default_address as proto_default_address

if TYPE_CHECKING:
    from .models.family import GraphBuckets


def default_address() -> str:
    """The address clients also default to (``code2wav.proto.address``: ``$CODE2WAV_SIDECAR_ADDRESS``, else an
    ipc:// socket under ``$XDG_RUNTIME_DIR`` or ``/tmp/code2wav-sidecar-<uid>``, created 0700 at bind time)."""
    return proto_default_address(os.environ, os.getuid())


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamsConfig(_Section):
    max_streams: int | None = Field(None, ge=1, description="stream slots in the state arena; unset = as many as "
                                    "state_memory_bytes holds")
    state_memory_bytes: Annotated[int, Field(ge=1 << 20)] | Literal["auto"] = Field(
        "auto", description="state arena budget when max_streams is unset; auto = on CUDA, from the device memory "
        "free after the weights (sidecar/arena_sizing.py: less the graph budget and state_memory_margin_bytes, at "
        "most auto_max_streams slots); on CPU 256 MiB (~50 streams fp32: a laptop's idle server stays under 1.5 GB)")
    state_memory_margin_bytes: int = Field(8 << 30, ge=0, description="device memory left free when the arena is "
                                           "sized from free memory (eager steps, workspace, other processes)")
    auto_max_streams: int = Field(4096, ge=1, description="most slots when the arena is sized from free memory")
    ttl_s: float = Field(600.0, gt=0, description="streams idle longer than this are reaped")
    client_silence_s: float = Field(60.0, gt=0, description="a client not heard from for this long (not even its "
                                    "heartbeat ping, sent every heartbeat_interval_s while idle) is gone: its "
                                    "streams are freed and its session forgotten, before their TTL (the TTL if that "
                                    "is shorter); at least 4 heartbeat intervals")


class SchedulerConfig(_Section):
    max_batch_size: int = Field(64, ge=1)
    batch_window_us: int = Field(200, ge=0, description="how long a lone chunk waits for company "
                                 "(none when every open stream has a chunk queued)")
    max_pending_chunks: int = Field(4096, ge=1, description="queued chunks beyond this get a busy error")
    # at most 2: the graph routines stage a step's inputs in one of 2 pinned sets (graphs/routine.py)
    max_steps_in_flight: Annotated[int, Field(ge=1, le=2)] | Literal["auto"] = Field(
        "auto", description="steps queued on the device at once: 2 = the next batch (of other streams) is staged and "
        "launched while a step runs, for steps whose chunks travel as inline bytes both ways; 1 = each step alone; "
        "auto = 2 on CUDA, 1 on CPU (where a step is computed as it is launched)")


class EngineConfig(_Section):
    max_forward_frames: int = Field(256, ge=1, description="longer chunks are decoded in exact slices")
    fused_kernels: bool = Field(True, description="on CUDA, the decoder family's hand-written Triton kernels "
                                "(sidecar/kernels/: Snake fused with the next conv's state concatenation and the "
                                "previous conv's bias, with the last one-channel conv and with depthwise convs; a "
                                "dense conv as an implicit GEMM where it measures fastest) in eager steps and CUDA "
                                "graphs; false = torch ops "
                                "(ignored on CPU)")
    kernel_choice_cache_dir: str = Field("~/.cache/code2wav-sidecar", description="on CUDA, where the dense "
                                         "convs' measured forms are kept per GPU model and library versions, so a "
                                         "restart reads them instead of timing every form again; empty = measure "
                                         "at every start")


_Sizes = tuple[Annotated[int, Field(ge=1)], ...]


class GraphsConfig(_Section):
    enabled: bool = Field(True, description="capture CUDA graphs (ignored on CPU: eager)")
    mode: Literal["startup", "startup_lazy", "lazy"] = "startup"
    # bucket sizes; unset: the model family's defaults (``graph_buckets`` in its family.py: the chunk shapes its
    # clients send), see GraphsConfig.for_family
    exact_batch_sizes: _Sizes | None = None
    exact_frames: _Sizes | None = None
    window_batch_sizes: _Sizes | None = None
    window_frames: _Sizes | None = None
    max_lazy_captures: int = Field(8, ge=0)
    max_graph_memory_bytes: int | None = Field(2 << 30, ge=0, description="graph pool budget: a bucket past it is "
                                               "captured as exact-streaming time slices (the same audio, a smaller "
                                               "peak), else skipped and run eager; null = no cap")
    allow_tf32: bool = Field(False, description="TF32 matmul/conv: faster, but not exact to 1e-4")

    def for_family(self, defaults: GraphBuckets) -> "GraphsConfig":
        """This section with every unset bucket list taken from the model family's defaults."""
        names = [f.name for f in dataclasses.fields(defaults)]  # the bucket lists, named alike here
        return self.model_copy(update={n: getattr(defaults, n) for n in names if getattr(self, n) is None})


class LimitsConfig(_Section):
    max_message_bytes: int = Field(64 << 20, ge=1024)
    max_chunk_frames: int = Field(8192, ge=1)
    max_chunks_per_message: int = Field(1024, ge=1)
    max_streams_per_client: int = Field(16384, ge=1)
    max_pending_chunks_per_client: int = Field(2048, ge=1, description="queued chunks of one client; busy past it")
    max_left_context_frames: int = Field(1024, ge=0)


class SecurityConfig(_Section):
    curve_secret_key_file: str | None = Field(None, description="CurveZMQ server certificate (zmq.auth format, "
                                              "from `code2wav-sidecar keygen`); required for non-loopback TCP")
    insecure: bool = Field(False, description="allow a non-loopback TCP bind without CurveZMQ (logs a warning)")
    curve_allowed_clients_dir: str | None = Field(
        None, description="CurveZMQ only: a folder of client public key files (*.key); only those clients may "
        "connect (reloaded on SIGHUP). None: any client that has the server's public key")


class ServerConfig(_Section):
    address: str = Field(default_factory=default_address)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(9464, ge=0, le=65535, description="0 picks a free port")
    model: str = "default"
    model_name: str | None = Field(None, description="the served model's name (default: its family's, e.g. "
                                   "qwen3-tts-12hz)")
    device: str = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0
    heartbeat_interval_s: float = Field(0.5, gt=0)
    cuda_ipc: bool = Field(True, description="accept CUDA IPC regions from clients on the same GPU (CUDA only)")
    codes_event_timeout_s: float = Field(5.0, gt=0, description="a CUDA IPC chunk whose codes event is not "
                                         "complete after this long fails with deadline_exceeded")
    armed_wait_s: float = Field(0.25, gt=0, description="an armed CUDA IPC chunk (codes_token) whose doorbell has "
                                "not reached its token this long after its step was queued: the sidecar releases "
                                "the step's wait on the GPU and the chunk fails with deadline_exceeded (steps queued "
                                "behind it wait meanwhile); at most heartbeat_interval_s (the default: the lower "
                                "of the two)")
    shutdown_timeout_s: float = Field(20.0, gt=0, description="after the drain (SIGTERM/SIGINT), how long the "
                                      "socket stays open to send the replies still queued to connected clients; "
                                      "what is still queued then is dropped (a log line and "
                                      "code2wav_sidecar_shutdown_replies_unsent_total)")
    drain_grace_s: float = Field(0.0, ge=0, description="on SIGTERM/SIGINT, how long open streams are still "
                                 "served (new ones refused, the pong's load says draining) so a client pool can move "
                                 "them to other sidecars at a chunk boundary; the drain starts once none is open or "
                                 "this ran out; 0: at once")
    busy_poll_us: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="after any input or step, poll the socket (and the device, after a CUDA IPC step) "
        "without sleeping for this long: lower latency for one busy CPU core while traffic flows; 0 = always "
        "sleep; auto = 2000 on CUDA, 0 on CPU")
    cpu_threads: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="torch's CPU thread pool in the sidecar (torch.set_num_threads); auto = 1 on CUDA, where "
        "the host only copies replies (a pool over every core waits for whichever thread the OS parked: each new "
        "process on the host stalled a GPU sidecar for ~1-2 s), torch's default on CPU, where the model runs")
    trace_chunks: int = Field(0, ge=0, le=100_000, description="record the stage times of the last N chunks "
                              "(received, queued, taken into a batch, launched, done, reply sent; "
                              "sidecar/chunk_trace.py) and serve them as JSON at /debug/chunk-stages of the metrics "
                              "endpoint, for `bench --stages`; 0 = off (the endpoint answers 404)")
    profile_loop: bool = Field(False, description="serve a cProfile of the loop thread at the metrics endpoint: "
                               "/debug/loop-profile/start starts one, /debug/loop-profile stops it and answers its "
                               "functions as JSON (sidecar/loop_profile.py), for `bench --stages "
                               "--stages-loop-profile`; slows the loop while it runs; off = both answer 404")
    streams: StreamsConfig = StreamsConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    engine: EngineConfig = EngineConfig()
    graphs: GraphsConfig = GraphsConfig()
    limits: LimitsConfig = LimitsConfig()
    security: SecurityConfig = SecurityConfig()

    @model_validator(mode="after")
    def _silence_outlasts_heartbeats(self) -> "ServerConfig":
        if self.streams.client_silence_s < 4 * self.heartbeat_interval_s:
            raise ValueError(f"streams.client_silence_s ({self.streams.client_silence_s:g}) must be at least 4 x "
                             f"heartbeat_interval_s ({self.heartbeat_interval_s:g}): a live client is silent for up "
                             "to one interval between pings; raise client_silence_s or lower the interval")
        if "armed_wait_s" in self.model_fields_set and self.armed_wait_s > self.heartbeat_interval_s:
            raise ValueError(f"armed_wait_s ({self.armed_wait_s:g}) must be at most heartbeat_interval_s "
                             f"({self.heartbeat_interval_s:g}): while a step waits for a doorbell the loop can "
                             "wait with it (a kernel loaded for the first time waits for the device), and clients "
                             "take a sidecar silent for 3 intervals for dead; lower armed_wait_s or raise the "
                             "interval")
        return self


AUTO_BUSY_POLL_US = 2000
"""Covers the gap between a step's end and the next chunk of a client at concurrency 1 (about 0.5 ms on the H200)."""


def busy_poll_s(cfg: ServerConfig, device_type: str) -> float:
    """The busy-poll window in seconds (``busy_poll_us`` with ``auto`` resolved for the device)."""
    if cfg.busy_poll_us == "auto":
        return AUTO_BUSY_POLL_US / 1e6 if device_type == "cuda" else 0.0
    return cfg.busy_poll_us / 1e6


def armed_wait_s(cfg: ServerConfig) -> float:
    """``armed_wait_s``, at most ``heartbeat_interval_s``: a value set above it is refused at load, the default (0.25 s)
    under a shorter interval takes the interval."""
    return min(cfg.armed_wait_s, cfg.heartbeat_interval_s)


def steps_in_flight(cfg: ServerConfig, device_type: str) -> int:
    """``scheduler.max_steps_in_flight`` with ``auto`` resolved for the device."""
    if cfg.scheduler.max_steps_in_flight == "auto":
        return 2 if device_type == "cuda" else 1
    return cfg.scheduler.max_steps_in_flight


def cpu_threads(cfg: ServerConfig, device_type: str) -> int | None:
    """Threads for torch's CPU pool (``cpu_threads`` with ``auto`` resolved for the device); None: leave torch's
    default."""
    if cfg.cpu_threads == "auto":
        return 1 if device_type == "cuda" else None
    return cfg.cpu_threads


def state_memory_bytes(cfg: ServerConfig) -> int | None:
    """The stream arena budget in bytes, or None for ``auto``: ``arena_sizing.plan_arena`` sizes the arena then
    (from free device memory on CUDA, its CPU default on the CPU)."""
    budget = cfg.streams.state_memory_bytes
    return None if budget == "auto" else budget


class ConfigError(ValueError):
    pass


REMOVED_KEYS = {
    "graphs.cap_batch_to_buckets": "batches are always capped to the largest captured graph batch (a larger batch "
                                   "ran eager, many times slower)",
    "graphs.cudnn_benchmark": "the dense convs' forms are timed per shape at graph warm-up (ConvChoice) instead",
    "graphs.compile": "the torch.compile'd step lost to the captured step with the measured kernel forms (H100, "
                      "bf16, same run: 1,808 vs 4,267 audio-s/s at 64 x 25, 3.48 vs 1.21 ms at 1 x 25)",
    "graphs.compile_cache_dir": "graphs.compile went (the captured step with the measured kernel forms is faster)",
}
"""Keys earlier versions took, and why they went: a config that still sets one is told so by name."""


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
    return list(model.model_fields)


def _explain(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        dotted = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden" and dotted in REMOVED_KEYS:
            lines.append(f"'{dotted}' was removed ({REMOVED_KEYS[dotted]}); delete it from the config")
        elif err["type"] == "extra_forbidden":
            known = _known_keys(ServerConfig, loc)
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys here: {', '.join(known)}"
            lines.append(f"unknown key '{dotted}' ({hint})")
        elif not loc:  # a check across keys (a model validator): its message names the keys
            lines.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            lines.append(f"{dotted}: {err['msg']} (got {err.get('input')!r})")
    return f"invalid configuration in {source}: " + "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServerConfig:
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level")
        data.update(loaded)
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
            source = f"{source} + command line" if "command line" not in source else source
    try:
        return ServerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, source)) from None
