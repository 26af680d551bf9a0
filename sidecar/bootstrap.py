"""Start-up: build the server's parts from its config (model, state arena, CUDA graphs, engine, the batch policy
and scheduler, sessions, transport), in order, with progress logs. Nothing here runs after start-up.

Graph capture is its own explicit step (``build_graphs``): it logs each bucket (time, memory) as it goes,
and it runs on the engine thread so ``/healthz`` stays live meanwhile.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import zmq

from .arena_sizing import UNCAPPED_GRAPH_RESERVE_BYTES, ArenaPlan, plan_arena
from .config import ServerConfig, state_memory_bytes
from .engine import Engine
from .graphs.manager import GraphManager
from .graphs.plan import build_buckets
from .graphs.routine import StreamRoutine
from .ipc.cudart import CudaIpcError, host_id
from .ipc.device import CudaIpcDevice
from .chunk_trace import ChunkTrace
from .kernel_metrics import KernelChoiceCollector
from .kernels.choice_cache import ChoiceCache, ChoiceEvents
from .kernels.choice_cache import identity as choice_identity
from .kernels.conv_choice import attach_choices, stop_measuring
from .metrics import Metrics
from .models import FAMILIES, DecoderFamily, LoadedModel, load_model
from .modes import MODES
from .scheduler import Scheduler, batch_policy
from .sessions import Sessions
from .state_store import StateArena, slot_nbytes
from .transport import Transport

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """What ``build_engine_side`` made (in the engine thread)."""

    model: LoadedModel
    arena: StateArena
    engine: Engine
    scheduler: Scheduler


def load(cfg: ServerConfig, device, families: Sequence[DecoderFamily] = FAMILIES) -> LoadedModel:
    t0 = time.perf_counter()
    model = load_model(cfg.model, device, cfg.dtype, name=cfg.model_name, seed=cfg.seed, families=families,
                       fused_kernels=cfg.engine.fused_kernels)
    kernels = "fused Triton kernels" if model.fused_kernels else "torch ops"
    log.info("model '%s' (family %s, %s) loaded on %s as %s in %.1fs (%s)", model.name, model.family_name,
             model.source, device, cfg.dtype, time.perf_counter() - t0, kernels)
    return model


def with_family_buckets(cfg: ServerConfig, model: LoadedModel) -> ServerConfig:
    """``cfg`` with the graph bucket lists it leaves unset taken from the model family's defaults (logged)."""
    gcfg = cfg.graphs.for_family(model.family.graph_buckets)
    log.info("graph buckets (%s): exact batches %s x frames %s, window batches %s x frames %s", model.family_name,
             list(gcfg.exact_batch_sizes), list(gcfg.exact_frames), list(gcfg.window_batch_sizes),
             list(gcfg.window_frames))
    return cfg.model_copy(update={"graphs": gcfg})


def build_arena(cfg: ServerConfig, model: LoadedModel, metrics: Metrics) -> StateArena:
    layout = model.state_layout()
    plan = plan_arena_for(cfg, slot_nbytes(layout, model.dtype), model.device)
    num_slots = plan.num_slots
    arena = StateArena(layout, num_slots, model.dtype, model.device)
    log.info("stream state: %s", plan.describe(arena.bytes_per_stream))
    metrics.state_bytes_per_stream.labels(model=model.name).set(arena.bytes_per_stream)
    metrics.arena_slots.labels(model=model.name, kind="total").set(num_slots)
    metrics.arena_slots.labels(model=model.name, kind="used").set(0)
    metrics.start_series(model.name, tuple((k.mode, k.label) for k in configured_buckets(cfg.graphs)),
                         dtype=str(model.dtype).removeprefix("torch."), device=str(model.device))
    return arena


def plan_arena_for(cfg: ServerConfig, bytes_per_stream: int, device) -> ArenaPlan:
    """Arena slots (policy: arena_sizing): on CUDA, measured free device memory less what the graphs may take."""
    scfg, gcfg = cfg.streams, cfg.graphs
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    graphs_on = device.type == "cuda" and gcfg.enabled
    reserve = (gcfg.max_graph_memory_bytes if gcfg.max_graph_memory_bytes is not None
               else UNCAPPED_GRAPH_RESERVE_BYTES) if graphs_on else 0
    return plan_arena(bytes_per_stream, max_streams=scfg.max_streams,
                      state_memory_bytes=state_memory_bytes(cfg), free_device_bytes=free,
                      graph_reserve_bytes=reserve, margin_bytes=scfg.state_memory_margin_bytes,
                      auto_max_streams=scfg.auto_max_streams)


def configured_buckets(gcfg) -> tuple:
    """The graph buckets the config names, every mode's (captured on CUDA; on CPU their metrics series still
    exist, at 0, so dashboards and alerts have data from the first scrape)."""
    buckets: tuple = ()
    for mode in MODES.values():
        batch_sizes, frames = mode.bucket_sizes(gcfg)
        buckets += build_buckets(mode.name, batch_sizes, frames)
    return buckets


def routine_shapes(gcfg, max_forward_frames: int) -> dict[str, tuple[int, int]]:
    """``mode -> (max_batch, max_frames)`` of each mode's static graph buffers; a mode with no buckets (an empty
    batch or frames list, e.g. ``window_batch_sizes: []``) gets no routine and runs eager."""
    shapes = {}
    for mode in MODES.values():
        batch_sizes, frames = mode.bucket_sizes(gcfg)
        if batch_sizes and frames:
            shapes[mode.name] = (max(batch_sizes), max(max(frames), max_forward_frames))
    return shapes


def build_graphs(cfg: ServerConfig, model: LoadedModel, arena: StateArena, metrics: Metrics) -> GraphManager:
    """CUDA graphs for every mode's configured buckets, captured now (the explicit start-up step)."""
    gcfg = cfg.graphs
    max_frames = cfg.engine.max_forward_frames
    buckets, routines = configured_buckets(gcfg), {}
    for name, (max_batch, max_routine_frames) in routine_shapes(gcfg, max_frames).items():
        routines[name] = StreamRoutine(model, arena if MODES[name].stateful else None, max_batch, max_routine_frames)
    manager = GraphManager(routines, buckets, model.device, metrics, mode=gcfg.mode,
                           max_lazy_captures=gcfg.max_lazy_captures,
                           max_graph_memory_bytes=gcfg.max_graph_memory_bytes)
    manager.capture_startup()
    if gcfg.mode == "startup":  # every bucket measured and captured: serving steps of new shapes are not measured
        stop_measuring(model.module)  # (kernels/conv_choice.py: they take the nearest measured shape's form)
    return manager


def build_scheduler(cfg: ServerConfig, graphs: GraphManager | None) -> Scheduler:
    """The batch policy, decided once: the configured values, batches capped to the rows the captured stateful
    graphs serve (``scheduler.batch_policy``)."""
    largest = max((graphs.largest_captured_batch(m.name) for m in MODES.values() if m.stateful), default=0) \
        if graphs is not None else 0
    scfg = cfg.scheduler
    policy = batch_policy(scfg.max_batch_size, scfg.batch_window_us, scfg.max_pending_chunks, largest,
                          graphs.longest_captured_frames() if graphs is not None else None)
    if policy.max_batch_size < scfg.max_batch_size:
        log.info("scheduler.max_batch_size %d capped to the largest captured graph batch (%d)", scfg.max_batch_size,
                 policy.max_batch_size)
    return Scheduler(policy)


def build_engine_side(cfg: ServerConfig, device, metrics: Metrics,
                      families: Sequence[DecoderFamily] = FAMILIES) -> Parts:
    """Model, arena, graphs, engine, scheduler: the slow part of start-up (run it on the engine thread)."""
    model = load(cfg, device, families)
    attach_kernel_choices(cfg, model, metrics)
    cfg = with_family_buckets(cfg, model)
    arena = build_arena(cfg, model, metrics)
    graphs = build_graphs(cfg, model, arena, metrics) if device.type == "cuda" and cfg.graphs.enabled else None
    engine = Engine(model, arena, cfg.engine.max_forward_frames, graphs=graphs, metrics=metrics)
    return Parts(model, arena, engine, build_scheduler(cfg, graphs))


def attach_kernel_choices(cfg: ServerConfig, model: LoadedModel, metrics: Metrics) -> None:
    """Name the model's conv choices, give them the on-disk cache of measured choices (CUDA, where configured) and
    export their counts (``kernel_metrics.py``)."""
    folder, cache = cfg.engine.kernel_choice_cache_dir, None
    if folder and model.device.type == "cuda":
        try:
            cache = ChoiceCache(folder, choice_identity(model.device))
        except (OSError, RuntimeError) as exc:  # e.g. "~" for a user without a home directory
            log.warning("kernel choice cache %s not used (%s): conv forms are measured at every start; set "
                        "engine.kernel_choice_cache_dir to a writable folder", folder, exc)
    events = ChoiceEvents()
    attach_choices(model.module, cache, events)
    metrics.registry.register(KernelChoiceCollector(events))


def open_ipc_device(cfg: ServerConfig, device) -> tuple[CudaIpcDevice | None, str]:
    """What opens clients' CUDA IPC regions, or None and why not."""
    reason, ipc_device = "", None
    if device.type != "cuda":
        reason = "the sidecar runs on the CPU"
    elif not cfg.cuda_ipc:
        reason = "disabled by the cuda_ipc setting"
    else:
        try:
            ipc_device = CudaIpcDevice(device)
        except CudaIpcError as exc:
            reason = str(exc)
    log.info("CUDA IPC regions: %s", f"accepted on {ipc_device.uuid}" if ipc_device else f"off ({reason})")
    return ipc_device, reason


def build_sessions(cfg: ServerConfig, parts: Parts, metrics: Metrics, trace: ChunkTrace | None = None) -> Sessions:
    ipc_device, ipc_off_reason = open_ipc_device(cfg, parts.model.device)
    return Sessions(cfg, parts.model, parts.arena, parts.scheduler, metrics, ipc_device, host_id(), ipc_off_reason,
                    trace=trace)


def build_transport(cfg: ServerConfig, context: zmq.Context) -> Transport:
    sec = cfg.security
    return Transport(context, cfg.address, cfg.limits.max_message_bytes, sec.curve_secret_key_file, sec.insecure)
