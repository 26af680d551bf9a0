"""Measured kernel choices kept between starts, and the counts of what the choices did.

Rules:
- ``ChoiceCache``: one JSON file per (GPU, compute capability, torch, CUDA, cuDNN, Triton, this package's version,
  a hash of the forms' source files, the TF32 switches) under a folder (``engine.kernel_choice_cache_dir``); the
  file name carries a hash of that identity and the file repeats it in plain words. An entry maps a conv (its
  module path and geometry: channels, kernel size, dilation, groups, bias) and input shape key to the chosen form
  and every form's time. A changed GPU, library, kernel source or math setting gives another file, never a stale
  choice; two trees of the code (an A/B run) keep apart.
- The file is JSON only, written atomically (a temporary file renamed over it, mode 0644, merged with what another
  process wrote meanwhile); an unreadable or foreign file is logged and ignored (measured again), an entry of the
  wrong types dropped; never trusted in part. A folder that cannot be written is said once, then left alone.
- ``ChoiceEvents``: thread-safe counts of decisions (by form and source: measured or cache) and fallbacks (by
  reason), read by the metrics endpoint's thread while the engine's thread adds to them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections import Counter
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FORMAT = 1
"""The file layout's version (in the identity)."""


def identity(device: torch.device) -> dict:
    """What a measured choice depends on, for ``device`` (a CUDA device)."""
    from importlib import metadata

    from . import conv_gemm, conv_gemm_cl, conv_gemm_tma, conv_im2col, unit_tma

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    from . import conv_forms, snake_kernels, snake_math

    sources = hashlib.sha1()
    for module in (conv_forms, conv_gemm, conv_gemm_cl, conv_gemm_tma, conv_im2col, snake_kernels, snake_math,
                   unit_tma):
        sources.update(Path(module.__file__).read_bytes())
    props = torch.cuda.get_device_properties(device)
    return {"format": FORMAT, "gpu": props.name, "capability": f"{props.major}.{props.minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "triton": version("triton"), "code2wav": version("code2wav-sidecar"),
            "forms_source": sources.hexdigest()[:16],
            "tf32": [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32],
            "tiles": [list(map(list, conv_gemm.CONFIGS)), list(map(list, conv_gemm_cl.CONFIGS)),
                      list(map(list, conv_gemm_tma.CONFIGS)), list(map(list, unit_tma.CONFIGS)),
                      conv_im2col.MAX_COPY_NBYTES]}


def geometry(conv: torch.nn.Conv1d) -> str:
    """A conv's shape as the file key names it: ``C_in x C_out, k, d, groups, bias``."""
    return (f"{conv.in_channels}x{conv.out_channels}k{conv.kernel_size[0]}d{conv.dilation[0]}g{conv.groups}"
            f"b{int(conv.bias is not None)}")


def shape_key(name: str, conv_geometry: str, key: tuple) -> str:
    """A decision key (``ConvChoice.key``: shape, dtype, device, epilogue as ``act<n>``, kernels) of conv ``name`` of
    ``conv_geometry`` as a file key, less the device index (one file per GPU model)."""
    *shape, dtype, _device, with_act, kernels = key
    return (f"{name}|{conv_geometry}|{'x'.join(map(str, shape))}|{str(dtype).replace('torch.', '')}"
            f"|act{int(with_act)}|k{int(kernels)}")


def _valid(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("form"), str) and isinstance(entry.get("timings_ms"), dict)
            and all(isinstance(f, str) and isinstance(ms, (int, float)) for f, ms in entry["timings_ms"].items()))


class ChoiceCache:
    """The measured choices of one GPU model and library set, read at start and written as they are made."""

    def __init__(self, folder: str | os.PathLike, ident: dict) -> None:
        """``ident``: what the choices depend on (``identity(device)`` for a CUDA device)."""
        self.identity = ident
        digest = hashlib.sha1(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        self.path = Path(folder).expanduser() / f"conv-choices-{digest}.json"
        self.entries: dict[str, dict] = self._read()
        self.writable = True
        log.info("kernel choices: %s (%d cached)", self.path, len(self.entries))

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("kernel choice cache %s unreadable (%s); measuring again", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.get("identity") != self.identity or \
                not isinstance(data.get("entries"), dict):
            log.warning("kernel choice cache %s is not this GPU's and versions'; measuring again", self.path)
            return {}
        return {k: v for k, v in data["entries"].items() if _valid(v)}

    def lookup(self, name: str, conv_geometry: str, key: tuple) -> tuple[str, dict[str, float]] | None:
        """``(form, timings_ms)`` cached for conv ``name`` (``geometry``) at ``key``, or None."""
        entry = self.entries.get(shape_key(name, conv_geometry, key))
        if entry is None:
            return None
        return entry["form"], {str(f): float(ms) for f, ms in entry["timings_ms"].items()}

    def store(self, name: str, conv_geometry: str, key: tuple, form: str, timings_ms: dict[str, float]) -> None:
        """Keep a measured choice and rewrite the file (atomically, merged with what another process wrote since
        this one read it; a failure to write is logged once, not raised)."""
        self.entries[shape_key(name, conv_geometry, key)] = {
            "form": form, "timings_ms": {f: round(ms, 6) for f, ms in timings_ms.items()}}
        if not self.writable:
            return
        temp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.entries = {**self._read(), **self.entries}
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, prefix=".conv-choices-", suffix=".tmp",
                                             delete=False) as f:
                temp = f.name
                json.dump({"identity": self.identity, "entries": self.entries}, f, indent=1, sort_keys=True)
            os.chmod(temp, 0o644)
            os.replace(temp, self.path)
        except OSError as exc:
            self.writable = False
            if temp is not None:
                Path(temp).unlink(missing_ok=True)
            log.warning("kernel choice cache %s not written (%s); this server measures new shapes without keeping "
                        "them, and the next start measures again", self.path, exc)


class ChoiceEvents:
    """Counts of the kernel choices' decisions and fallbacks (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decisions: Counter[tuple[str, str]] = Counter()
        self._fallbacks: Counter[str] = Counter()

    def decided(self, form: str, source: str) -> None:
        with self._lock:
            self._decisions[(form, source)] += 1

    def fell_back(self, reason: str) -> None:
        with self._lock:
            self._fallbacks[reason] += 1

    def snapshot(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        """``(decisions by (form, source), fallbacks by reason)``, copies."""
        with self._lock:
            return dict(self._decisions), dict(self._fallbacks)
