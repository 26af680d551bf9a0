"""Load vLLM-Omni 0.30's Qwen3-TTS Code2Wav modules where vLLM itself is not installed (the GPU machine).

vLLM-Omni's wheel is about 8 MB; vLLM's is too large to carry to a machine without network. The modules the
``vllm-omni-stock`` baseline runs (``qwen3_tts_code2wav``, ``tokenizer_12hz/*``, ``segmented_graph_wrapper``,
``cuda_graph_decoder_wrapper`` and the small helpers they import) touch exactly these vLLM names, found by
importing them with every ``vllm.*`` import blocked and recorded:

    vllm.config.VllmConfig                       annotation only
    vllm.forward_context.get_forward_context     only inside vLLM's runner (never reached here)
    vllm.forward_context.is_forward_context_available
    vllm.logger.init_logger                      a logger with ``warning_once``/``info_once``/``debug_once``
    vllm.model_executor.model_loader.DefaultModelLoader   ``Source`` + ``_get_weights_iterator`` (safetensors)
    vllm.model_executor.models.utils.AutoWeightsLoader    ``load_weights(weights, mapper=...)``
    vllm.model_executor.models.utils.WeightsMapper        ``orig_to_new_prefix`` (``None`` drops a prefix)
    vllm.platforms.current_platform              ``get_global_graph_pool()`` (one shared CUDA graph pool)
    vllm.sequence.IntermediateTensors            annotation only

``install()`` puts modules with just these names into ``sys.modules``, and only when ``import vllm`` fails. The
package ``__init__`` files of ``vllm_omni``, ``vllm_omni.model_executor`` and ``vllm_omni.model_executor.models``
import vLLM's engine config and model registry (most of vLLM); with the shim those three packages are made
importable without running their ``__init__`` (their submodules load from the installed files, unchanged).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

_BARE_PACKAGES = ("vllm_omni", "vllm_omni.model_executor", "vllm_omni.model_executor.models")


def vllm_omni_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm_omni") is not None
    except ImportError:  # an import hook that refuses the name
        return False


def vllm_importable() -> bool:
    """True when the real vLLM imports (the shim stays out of the way)."""
    if isinstance(sys.modules.get("vllm"), _ShimModule):
        return False
    try:
        importlib.import_module("vllm")
    except ImportError:
        return False
    return True


def install() -> bool:
    """Make vLLM-Omni's Code2Wav modules importable; returns True when the shim was needed (vLLM missing)."""
    if isinstance(sys.modules.get("vllm"), _ShimModule):
        return True
    if vllm_importable():
        return False
    for name, attrs in _shim_modules().items():
        module = _ShimModule(name)
        module.__path__ = []  # a package, so ``vllm.x.y`` resolves
        module.__dict__.update(attrs)
        sys.modules[name] = module
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, module)
    for name in _BARE_PACKAGES:
        _bare_package(name)
    return True


class _ShimModule(types.ModuleType):
    """A ``vllm.*`` module of the shim (``isinstance`` tells the shim from the real package)."""


def _bare_package(name: str) -> None:
    """Register package ``name`` (files as installed) without executing its ``__init__.py``."""
    if name in sys.modules:
        return
    parent, _, leaf = name.rpartition(".")
    search = sys.modules[parent].__path__ if parent else None
    spec = importlib.machinery.PathFinder.find_spec(leaf, search)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not an installed package (pip install vllm-omni==0.30.0)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if parent:
        setattr(sys.modules[parent], leaf, module)


class _OnceLogger(logging.LoggerAdapter):
    """What ``vllm.logger.init_logger`` returns, as far as these modules use it."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})
        self._said: set[tuple[str, str]] = set()

    def _once(self, level: str, msg: str, *args, **kwargs) -> None:
        key = (level, msg % args if args else msg)
        if key not in self._said:
            self._said.add(key)
            getattr(self, level)(msg, *args, **kwargs)

    def warning_once(self, msg: str, *args, **kwargs) -> None:
        self._once("warning", msg, *args, **kwargs)

    def info_once(self, msg: str, *args, **kwargs) -> None:
        self._once("info", msg, *args, **kwargs)

    def debug_once(self, msg: str, *args, **kwargs) -> None:
        self._once("debug", msg, *args, **kwargs)


def init_logger(name: str) -> _OnceLogger:
    return _OnceLogger(logging.getLogger(name))


def is_forward_context_available() -> bool:
    return False  # no vLLM runner step is ever active in the baseline


def get_forward_context():
    raise RuntimeError("vllm shim: there is no vLLM forward context outside vLLM's model runner")


class _Platform:
    """``current_platform``: the one CUDA graph memory pool all captures share (vLLM's global pool)."""

    def __init__(self) -> None:
        self._pool = None

    def get_global_graph_pool(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool


@dataclass
class LoadConfig:
    load_format: str = "auto"


class DefaultModelLoader:
    """Reads ``<model_or_path>/<subfolder>/*.safetensors`` (a local folder; there is no network here)."""

    @dataclass
    class Source:
        model_or_path: str
        revision: str | None
        subfolder: str | None = None
        prefix: str = ""
        fall_back_to_pt: bool = True
        allow_patterns_overrides: list[str] | None = None

    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config

    def _get_weights_iterator(self, source: DefaultModelLoader.Source) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        folder = Path(source.model_or_path) / (source.subfolder or "")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"vllm shim: no *.safetensors in {folder}")
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    yield source.prefix + key, f.get_tensor(key)


@dataclass
class WeightsMapper:
    orig_to_new_prefix: Mapping[str, str | None] = field(default_factory=dict)

    def map_name(self, name: str) -> str | None:
        for old, new in self.orig_to_new_prefix.items():
            if name.startswith(old):
                return None if new is None else new + name[len(old):]
        return name


class AutoWeightsLoader:
    """Copies each (mapped) checkpoint tensor into the module's parameter or buffer of that name."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def load_weights(self, weights, *, mapper: WeightsMapper | None = None) -> set[str]:
        targets = dict(self.module.named_parameters())
        targets.update(self.module.named_buffers())
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                name = mapper.map_name(name) if mapper is not None else name
                if name is None:
                    continue
                if name not in targets:
                    raise ValueError(f"vllm shim: there is no parameter or buffer named {name!r} in "
                                     f"{type(self.module).__name__}")
                if targets[name].shape != tensor.shape:
                    raise ValueError(f"vllm shim: {name}: checkpoint {tuple(tensor.shape)} vs model "
                                     f"{tuple(targets[name].shape)}")
                targets[name].copy_(tensor)
                loaded.add(name)
        return loaded


class VllmConfig:
    """Annotation only (the baseline passes a plain namespace)."""


class IntermediateTensors:
    """Annotation only."""


def _shim_modules() -> dict[str, dict[str, object]]:
    return {
        "vllm": {},
        "vllm.config": {"VllmConfig": VllmConfig, "LoadConfig": LoadConfig},
        "vllm.forward_context": {"get_forward_context": get_forward_context,
                                 "is_forward_context_available": is_forward_context_available},
        "vllm.logger": {"init_logger": init_logger},
        "vllm.model_executor": {},
        "vllm.model_executor.model_loader": {"DefaultModelLoader": DefaultModelLoader},
        "vllm.model_executor.models": {},
        "vllm.model_executor.models.utils": {"AutoWeightsLoader": AutoWeightsLoader,
                                             "WeightsMapper": WeightsMapper},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.sequence": {"IntermediateTensors": IntermediateTensors},
    }
