"""vLLM-Omni plugin: run the Qwen3-TTS Code2Wav stage's decoding in the code2wav sidecar.

``register()`` is the entry point of the ``vllm_omni.general_plugins`` group (see ``pyproject.toml``). vLLM-Omni
calls it in every process (API server, engine cores, workers); it adds ``Qwen3TTSCode2WavSidecar`` to vLLM-Omni's
``OmniModelRegistry`` (stages resolve architectures there, not in ``vllm.ModelRegistry``) as a lazy
``module:Class`` reference, so no CUDA or vLLM model code is imported at plugin time. It is idempotent and
leaves ``Qwen3TTSCode2Wav`` alone: a deploy file opts in with ``model_arch: Qwen3TTSCode2WavSidecar`` on the
Code2Wav stage (``deploy/vllm-omni/qwen3_tts_sidecar.yaml``; the wheel carries the same file, ``DEPLOY_CONFIG`` is
its installed path and ``python -m code2wav.client.vllm_omni`` prints it).

Nothing here needs vLLM to import: ``delegate`` and ``step`` are plain client code, ``model`` imports vLLM-Omni's
``OmniOutput`` only when it builds one.
"""

import logging as _logging
from pathlib import Path as _Path

from .model import ARCH_NAME

__all__ = ["ARCH_NAME", "MODEL_CLASS_REF", "DEPLOY_CONFIG", "register", "register_arch"]

_log = _logging.getLogger(__name__)

MODEL_CLASS_REF = "code2wav.client.vllm_omni.model:Qwen3TTSCode2WavSidecar"
DEPLOY_CONFIG = _Path(__file__).with_name("qwen3_tts_sidecar.yaml")
"""The deploy overlay for ``vllm serve --omni --deploy-config`` (package data; the same bytes as the repository's
``deploy/vllm-omni/qwen3_tts_sidecar.yaml``)."""


def register() -> None:
    """Add ``ARCH_NAME`` to vLLM-Omni's ``OmniModelRegistry``; a no-op when it is there or vLLM-Omni is absent."""
    register_arch(ARCH_NAME, MODEL_CLASS_REF)


def register_arch(arch_name: str, class_ref: str) -> None:
    """Add ``arch_name`` -> ``class_ref`` (``module:Class``, imported lazily) to vLLM-Omni's ``OmniModelRegistry``;
    idempotent, and a no-op when vLLM-Omni is absent. Every plugin entry point of this package uses it."""
    try:
        from vllm_omni.model_executor.models.registry import OmniModelRegistry
    except ImportError as exc:  # the plugin is installed with the client, vLLM-Omni may not be
        _log.debug("code2wav-sidecar: vLLM-Omni not importable (%s); nothing to register", exc)
        return
    existing = OmniModelRegistry.models.get(arch_name)
    if existing is not None and getattr(existing, "module_name", None) == class_ref.split(":")[0]:
        return
    OmniModelRegistry.register_model(arch_name, class_ref)
    _log.debug("code2wav-sidecar: registered %s -> %s in OmniModelRegistry", arch_name, class_ref)
