"""vLLM-Omni plugin for VoxCPM2: the talker's AudioVAE decode runs in the code2wav sidecar (exact streaming).

vLLM-Omni 0.30 runs VoxCPM2 as ONE stage (``VoxCPM2TalkerForConditionalGeneration``): the LM, the LocDiT and the
AudioVAE decode all live in the talker, so there is no Code2Wav stage to replace. The smallest hook is a
``model_arch`` overlay: ``VoxCPM2TalkerSidecar`` subclasses the installed talker and overrides the one method
every VAE decode goes through (``_collect_audio_batch``) and the per-request cleanup (see ``mixin``). A deploy
file opts in with ``model_arch: VoxCPM2TalkerSidecar`` on stage 0 (docs/voxcpm2.md).

``register()`` is an entry point of the ``vllm_omni.general_plugins`` group; it adds the architecture to
``OmniModelRegistry`` as a lazy ``module:Class`` reference (no vLLM model code is imported at plugin time).
"""

from ..vllm_omni import register_arch as _register_arch

__all__ = ["ARCH_NAME", "MODEL_CLASS_REF", "register"]

ARCH_NAME = "VoxCPM2TalkerSidecar"
MODEL_CLASS_REF = "code2wav.client.vllm_omni_voxcpm2.model:VoxCPM2TalkerSidecar"


def register() -> None:
    """Add ``ARCH_NAME`` to vLLM-Omni's ``OmniModelRegistry``; a no-op when it is there or vLLM-Omni is absent."""
    _register_arch(ARCH_NAME, MODEL_CLASS_REF)
