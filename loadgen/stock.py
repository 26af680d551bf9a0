"""The ``vllm-omni-stock`` baseline: vLLM-Omni 0.30's own ``Qwen3TTSCode2Wav`` (imported, not re-implemented),
configured by its shipped ``deploy/qwen3_tts.yaml`` and loaded with the same weights as our model.

Built the way vLLM builds the stage-1 model: ``Qwen3TTSCode2Wav(vllm_config=...)``, moved to the device and dtype,
then its own ``load_weights`` reads a ``speech_tokenizer/`` checkpoint folder (written here from our model's
``state_dict``: the names are the checkpoint's), applies the connector ``extra`` of the deploy file
(``codec_chunk_frames`` 25, ``codec_left_context_frames`` 72, ``initial_codec_chunk_frames`` 1,
``decode_batch_max_size`` 4) and, on CUDA unless ``enforce_eager``, captures its ``CUDAGraphDecoderWrapper``
graphs (default batch sizes: ``[1]``). Chunks are fed as vLLM-Omni's async-chunk connector emits them
(codebook-major codes with ``meta``), so its per-request decoder state cache does the streaming.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from . import stock_shim
from .timing import sync_device

log = logging.getLogger(__name__)

DEPLOY_FILE = "qwen3_tts.yaml"
STAGE_ID = 1


class StockUnavailable(RuntimeError):
    """vLLM-Omni is not installed (the message says how to install it)."""


def deploy_settings() -> dict[str, Any]:
    """Stage 1's settings from vLLM-Omni's shipped deploy file: the connector ``extra``, ``enforce_eager`` and
    ``async_chunk``, read from the installed package (not copied). ``path`` names the file inside the package, not
    where this machine installed it (reports are kept)."""
    import yaml

    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        raise StockUnavailable("vllm-omni is not installed: pip install vllm-omni==0.30.0 (plus vllm==0.30.0, "
                               "or the shim in loadgen/stock_shim.py where vLLM cannot be installed)")
    path = Path(spec.submodule_search_locations[0]) / "deploy" / DEPLOY_FILE
    doc = yaml.safe_load(path.read_text())
    stage = next(s for s in doc["stages"] if s["stage_id"] == STAGE_ID)
    connector_name = next(iter(stage["input_connectors"].values()))
    extra = dict(doc["connectors"][connector_name]["extra"])
    return {"path": f"vllm_omni/deploy/{DEPLOY_FILE}", "extra": extra,
            "enforce_eager": bool(stage.get("enforce_eager", False)),
            "async_chunk": bool(doc.get("async_chunk", False)), "stage_dtype": stage.get("dtype")}


def write_checkpoint(model, root: Path) -> Path:
    """``root/speech_tokenizer/{config.json, model.safetensors}`` holding ``model``'s decoder weights."""
    from safetensors.torch import save_file

    folder = root / "speech_tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.module.cfg
    decoder_config = cfg.model_dump(mode="json")
    config = {"model_type": "qwen3_tts_tokenizer_12hz", "encoder_config": {}, "decoder_config": decoder_config,
              "output_sample_rate": model.sample_rate_hz, "decode_upsample_rate": cfg.samples_per_frame}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = {"decoder." + k: v.detach().to("cpu").contiguous()
               for k, v in model.module.decoder.state_dict().items()}
    save_file(weights, str(folder / "model.safetensors"))
    return root


@dataclass
class StockCode2Wav:
    """A built baseline: the real ``Qwen3TTSCode2Wav`` and what building it cost."""

    module: Any  # vllm_omni ... Qwen3TTSCode2Wav
    device: torch.device
    num_quantizers: int
    samples_per_frame: int
    settings: dict
    vllm_shim: bool
    graphs: bool
    startup_s: float
    capture_s: float | None = None
    graph_memory_bytes: int | None = None  # CUDA memory reserved by its capture (graph pool, static buffers)
    graph_allocated_bytes: int | None = None  # of which still allocated after it
    graph_batch_sizes: list[int] = field(default_factory=list)
    graph_seq_lens: list[int] = field(default_factory=list)

    def step(self, chunks: list[tuple[str, torch.Tensor, int, bool]]) -> list[torch.Tensor]:
        """One runner step: ``(request_id, codes [Q, n], reference_frames, finished)`` per request, as the
        async-chunk connector delivers them (the first chunk carries the reference codes in front); returns
        each request's audio ``[(n - reference_frames) * U]`` (float32, on the device)."""
        payloads, flat = [], []
        for request_id, codes, ref_frames, finished in chunks:
            codes_flat = codes.to(self.device, torch.long).reshape(-1)  # [Q * n], codebook-major
            meta: dict[str, Any] = {"request_id": request_id, "left_context_size": ref_frames,
                                    "finished": torch.tensor(finished)}
            if ref_frames:
                meta.update(ref_context_size=ref_frames, ref_context_request_id=request_id,
                            ref_context_included=True)
            payloads.append({"codes": {"audio": codes_flat}, "meta": meta})
            flat.append(codes_flat)
        input_ids = torch.cat(flat)  # [sum Q * n]
        out = self.module(input_ids=input_ids, positions=torch.arange(input_ids.numel(), device=self.device),
                          runtime_additional_information=payloads, seq_token_counts=[f.numel() for f in flat],
                          request_ids=[c[0] for c in chunks])
        return list(out.multimodal_outputs["model_outputs"])

    def finish(self, request_ids: list[str]) -> None:
        """What the runner does when requests end (frees their decoder state)."""
        self.module.on_requests_finished(request_ids)

    def stream(self, codes: torch.Tensor, sizes: list[int], ref_frames: int = 0, request_id: str = "s0") -> torch.Tensor:
        """Decode one stream chunk by chunk (``sizes`` new frames each; the reference codes, the first
        ``ref_frames`` of ``codes``, go with the first chunk); returns its audio ``[(T - ref_frames) * U]``."""
        pieces, start = [], 0
        for i, size in enumerate(sizes):
            end = start + size + (ref_frames if i == 0 else 0)
            final = i == len(sizes) - 1
            pieces.append(self.step([(request_id, codes[:, start:end], ref_frames if i == 0 else 0, final)])[0])
            start = end
        self.finish([request_id])
        return torch.cat(pieces).float().cpu()


def build_stock(model, *, enforce_eager: bool | None = None, graph_batch_sizes: list[int] | None = None,
                workdir: Path | None = None) -> StockCode2Wav:
    """vLLM-Omni's ``Qwen3TTSCode2Wav`` on ``model``'s device and dtype with ``model``'s weights.

    ``enforce_eager`` defaults to the deploy file's (false: graphs on CUDA); ``graph_batch_sizes`` sets
    ``decode_cudagraph_batch_sizes`` (default: the deploy file's, i.e. unset = ``[1]``)."""
    if not stock_shim.vllm_omni_installed():
        raise StockUnavailable("vllm-omni is not importable: pip install vllm-omni==0.30.0 to measure the "
                               "vllm-omni-stock baseline")
    settings = deploy_settings()
    extra = dict(settings["extra"])
    if graph_batch_sizes:
        extra["decode_cudagraph_batch_sizes"] = list(graph_batch_sizes)
    eager = settings["enforce_eager"] if enforce_eager is None else enforce_eager
    vllm_shim = stock_shim.install()
    from vllm.config import LoadConfig
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav

    device = model.device
    with tempfile.TemporaryDirectory(prefix="vllm-omni-stock-", dir=workdir) as tmp:
        root = write_checkpoint(model, Path(tmp))
        model_config = SimpleNamespace(model=str(root), revision=None, dtype=model.dtype, enforce_eager=eager,
                                       async_chunk=settings["async_chunk"],
                                       stage_connector_config={"name": "SharedMemoryConnector", "extra": extra})
        vllm_config = SimpleNamespace(model_config=model_config, load_config=LoadConfig(),
                                      device_config=SimpleNamespace(device=device))
        sync_device(device)
        t0 = time.perf_counter()
        module = Qwen3TTSCode2Wav(vllm_config=vllm_config).to(device=device, dtype=model.dtype).eval()
        timing = _CaptureTimer(module.decoder, device)
        loaded = module.load_weights(iter(()))  # its own loader: reads root/speech_tokenizer, then configures
        sync_device(device)
        startup_s = time.perf_counter() - t0
    expected = {"decoder." + k for k in module.decoder.state_dict()} - {n for n, _ in module.named_buffers()}
    missing = expected - set(loaded)
    if missing:
        raise RuntimeError(f"vllm-omni-stock: weights not loaded into Qwen3TTSCode2Wav: {sorted(missing)[:5]}")
    wrapper = getattr(module.decoder, "_cudagraph_wrapper", None)
    graphs = bool(getattr(module.decoder, "_cudagraph_enabled", False))
    stock = StockCode2Wav(module=module, device=device, num_quantizers=int(module._num_quantizers),
                          samples_per_frame=int(module._total_upsample), settings={**settings, "extra": extra},
                          vllm_shim=vllm_shim, graphs=graphs, startup_s=startup_s)
    if timing.seconds is not None:
        stock.capture_s, stock.graph_memory_bytes = timing.seconds, timing.memory_bytes
        stock.graph_allocated_bytes = timing.allocated_bytes
    if wrapper is not None:
        stock.graph_batch_sizes = list(wrapper.capture_batch_sizes)
        stock.graph_seq_lens = list(wrapper.icl_capture_sizes)
    return stock


class _CaptureTimer:
    """Times ``decoder.enable_cudagraph`` (the capture) and the CUDA memory it leaves allocated, by wrapping
    that one bound method on this instance (measurement only; the call itself is unchanged)."""

    def __init__(self, decoder, device: torch.device) -> None:
        self.seconds: float | None = None
        self.memory_bytes: int | None = None
        self.allocated_bytes: int | None = None
        inner = decoder.enable_cudagraph

        def timed(*args, **kwargs):
            sync_device(device)
            torch.cuda.empty_cache()  # the capture may empty the cache itself: start from an empty one
            before = torch.cuda.memory_reserved(device)
            allocated_before = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            result = inner(*args, **kwargs)
            sync_device(device)
            self.seconds = time.perf_counter() - t0
            self.memory_bytes = torch.cuda.memory_reserved(device) - before
            self.allocated_bytes = torch.cuda.memory_allocated(device) - allocated_before
            return result

        decoder.enable_cudagraph = timed
