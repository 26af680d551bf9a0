"""The VoxCPM2 delegate against the installed vLLM-Omni 0.30 talker class (CPU, no GPU, no checkpoint).

Contract: every AudioVAE decode of ``VoxCPM2TalkerForConditionalGeneration`` goes through the one method the
delegate overrides (checked on the installed source), with the signatures and request-state fields it uses.
Behaviour: the installed class with the delegate's overrides, fed the talker's per-step patches of two
interleaved requests (``vae_decode_every`` 2, one request stopping early), returns audio that equals one decode of
each request's latents. The talker instance is built without its ``__init__`` (that loads a real checkpoint: the
vLLM side is the external part here); the latents go to an in-process exact-streaming decoder of the golden model.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from code2wav.sidecar.models.voxcpm2_audiovae import VoxCPM2AudioVAEDecoder, load_folder

talker_mod = pytest.importorskip("vllm_omni.model_executor.models.voxcpm2.voxcpm2_talker")
Talker = talker_mod.VoxCPM2TalkerForConditionalGeneration
RequestState = talker_mod._RequestState

GOLDEN = Path(__file__).parent / "data" / "golden" / "voxcpm2_tiny_a"
TOL = 1e-5
PATCH = 4


class InProcessLatents:
    """The delegate's backend contract served by the family's own decoder, one exact state per request."""

    def __init__(self, model: VoxCPM2AudioVAEDecoder) -> None:
        self.model = model
        self.states: dict[str, dict[str, torch.Tensor]] = {}
        self.ended: list[str] = []

    def decode(self, chunks):
        out = []
        for request_id, latents, final in chunks:  # latents [D, n]
            state = self.states.get(request_id) or self.model.zero_state(1)
            with torch.no_grad():
                wav, state = self.model.forward_stream(latents[None], None, state)  # [1, n * U]
            self.states[request_id] = state
            if final:
                del self.states[request_id]
            out.append(wav[0])
        return out

    def end(self, request_id):
        self.ended.append(request_id)
        self.states.pop(request_id, None)


def _method_calls(cls, callee: str) -> set[str]:
    """Names of ``cls``'s methods whose source calls ``self.<callee>(``."""
    callers = set()
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if re.search(rf"self\.{callee}\(", inspect.getsource(fn)):
            callers.add(name)
    return callers


def test_every_vae_decode_goes_through_the_overridden_method():
    assert _method_calls(Talker, "_run_vae_decode") == {"_collect_audio", "_collect_audio_batch"}
    assert _method_calls(Talker, "_collect_audio") == {"_collect_audio_batch"}
    assert "audio_vae.decode(" not in "".join(inspect.getsource(fn) for name, fn in
                                            inspect.getmembers(Talker, inspect.isfunction)
                                            if name not in ("_run_vae_decode", "_capture_vae_graph",
                                                            "_setup_torch_compile"))
    sig = inspect.signature(Talker._collect_audio_batch)
    assert list(sig.parameters) == ["self", "states", "initial_delayed_chunks_by_req"]
    assert list(inspect.signature(Talker._cleanup_request).parameters) == ["self", "request_id"]
    fields = {f.name for f in talker_mod.dataclasses.fields(RequestState)}
    assert {"request_id", "last_audio_patch_gpu", "pending_vae_latents_gpu", "is_stopping"} <= fields


def test_registered_arch_is_a_talker_subclass():
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    from code2wav.client.vllm_omni_voxcpm2 import ARCH_NAME, register
    from code2wav.client.vllm_omni_voxcpm2.model import VoxCPM2TalkerSidecar

    register()
    register()  # idempotent
    assert OmniModelRegistry.models[ARCH_NAME].module_name == "code2wav.client.vllm_omni_voxcpm2.model"
    assert issubclass(VoxCPM2TalkerSidecar, Talker)
    assert VoxCPM2TalkerSidecar._collect_audio_batch is not Talker._collect_audio_batch


def _talker(backend: InProcessLatents, feat_dim: int, vae_decode_every: int):
    from code2wav.client.vllm_omni_voxcpm2.model import VoxCPM2TalkerSidecar

    talker = VoxCPM2TalkerSidecar.__new__(VoxCPM2TalkerSidecar)  # no checkpoint load (see the module docstring)
    torch.nn.Module.__init__(talker)
    talker._feat_dim = feat_dim
    talker._vae_decode_every = vae_decode_every
    talker._coalesce_audio_d2h = False
    talker._active_states = {}
    talker._current_request_id = None
    talker._sidecar = backend
    return talker


def test_talker_steps_decode_exactly_through_the_backend():
    model, _ = load_folder(GOLDEN)
    latents = load_file(str(GOLDEN / "cases.safetensors"))["latents"]  # [2, D, 57]
    D = latents.shape[1]
    num_patches = [14, 9]  # request b stops after 9 patches (36 frames)
    backend = InProcessLatents(model)
    talker = _talker(backend, D, vae_decode_every=2)
    states = [RequestState(request_id=f"req-{b}") for b in range(2)]
    for s in states:
        talker._active_states[s.request_id] = s
    audio: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in states}
    for step in range(max(num_patches)):
        live = [s for b, s in enumerate(states) if step < num_patches[b]]
        for b, s in enumerate(states):
            if step < num_patches[b]:
                frames = latents[b, :, step * PATCH:(step + 1) * PATCH].t()  # [PATCH, D]: the talker's layout
                s.last_audio_patch_gpu = frames[None].clone()  # [1, PATCH, D]
                s.is_stopping = step == num_patches[b] - 1
        out = talker._collect_audio_batch(live)
        assert set(out) == {s.request_id for s in live}
        for rid, wav in out.items():
            if wav is not None:
                audio[rid].append(wav)
    for b, s in enumerate(states):
        frames = num_patches[b] * PATCH
        with torch.no_grad():
            full = model(latents[b:b + 1, :, :frames])[0, 0]  # [frames * U]
        got = torch.cat(audio[s.request_id])
        assert got.shape == full.shape
        assert (got - full).abs().max().item() <= TOL
    assert backend.states == {}  # both streams ended with a final chunk (stopping), none left behind
    talker._cleanup_request("req-0")
    assert backend.ended == ["req-0"] and "req-0" not in talker._active_states
