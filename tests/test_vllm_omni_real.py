"""The delegate stage against the REAL vLLM-Omni 0.30 package (installed by ``.ci/install-vllm``; skipped without it).

- the plugin loads through the real ``vllm_omni.general_plugins`` entry point and vLLM-Omni's own loader, and the new
  architecture resolves through the real ``OmniModelRegistry`` (``Qwen3TTSCode2Wav`` untouched);
- the overlay ``deploy/vllm-omni/qwen3_tts_sidecar.yaml`` loads through vLLM-Omni's deploy-config loader, inherits
  the stock ``qwen3_tts.yaml``, puts the new architecture on stage 1 after the pipeline merge, and its connector
  ``extra`` is what the stage model reads;
- the stage model returns the real ``OmniOutput``, which the real runners' output code accepts;
- parity oracle: vLLM-Omni's own ``Qwen3TTSCode2Wav`` runs on CPU with the tiny config (golden ``tiny_a``) and its
  (window) decode equals the delegate's window mode; its one-shot decoder equals the delegate's exact mode.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed (bash .ci/install-vllm installs vllm==0.30.0 "
                    "vllm-omni==0.30.0 into the test environment)")

from safetensors.torch import load_file  # noqa: E402

from code2wav.client.vllm_omni import ARCH_NAME, MODEL_CLASS_REF, register  # noqa: E402
from code2wav.client.vllm_omni.model import Qwen3TTSCode2WavSidecar  # noqa: E402
from code2wav.client.vllm_omni.settings import connector_extra  # noqa: E402
from test_vllm_omni import (Q, U, V1Runner, V2Runner, make_checkpoint, make_model, payload, sched_id,  # noqa: E402
                            streaming_scenario)

ROOT = Path(__file__).resolve().parents[1]
OVERLAY = ROOT / "deploy" / "vllm-omni" / "qwen3_tts_sidecar.yaml"
DEPLOY_DIR = Path(importlib.util.find_spec("vllm_omni").submodule_search_locations[0]) / "deploy"


def test_versions_are_the_verified_ones():
    versions = {name: importlib.metadata.version(name) for name in ("vllm", "vllm-omni", "torch")}
    print("verified against", versions)
    assert versions["vllm-omni"].startswith("0.30."), versions
    assert versions["vllm"].startswith("0.30."), versions


def test_entry_point_registers_into_omni_model_registry():
    import vllm_omni.plugins as omni_plugins
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm_omni.general_plugins")}
    assert eps.get("code2wav_sidecar") == "code2wav.client.vllm_omni:register", eps
    stock = OmniModelRegistry.models["Qwen3TTSCode2Wav"]

    OmniModelRegistry.models.pop(ARCH_NAME, None)
    omni_plugins.omni_plugins_loaded = False  # as in a fresh process
    omni_plugins.load_omni_general_plugins()  # vLLM-Omni's own loader: entry points of both plugin groups
    assert ARCH_NAME in OmniModelRegistry.get_supported_archs()
    registered = OmniModelRegistry.models[ARCH_NAME]
    print(f"OmniModelRegistry: {len(OmniModelRegistry.get_supported_archs())} architectures, "
          f"{ARCH_NAME} -> {registered}")

    register()  # idempotent: every process loads plugins, some twice
    omni_plugins.omni_plugins_loaded = False
    omni_plugins.load_omni_general_plugins()
    assert OmniModelRegistry.models[ARCH_NAME] is registered
    assert OmniModelRegistry.models["Qwen3TTSCode2Wav"] is stock  # not hijacked
    assert f"{registered.module_name}:{registered.class_name}" == MODEL_CLASS_REF


def test_architecture_resolves_through_omni_model_registry():
    from vllm.model_executor.models.registry import _ModelInfo
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    register()
    model_config = SimpleNamespace(model_impl="auto", convert_type="none", runner_type="generate")
    cls, arch = OmniModelRegistry.resolve_model_cls([ARCH_NAME], model_config=model_config)
    assert (cls, arch) == (Qwen3TTSCode2WavSidecar, ARCH_NAME)
    ours, stock = _ModelInfo.from_model_cls(cls), _ModelInfo.from_model_cls(Qwen3TTSCode2Wav)
    assert dataclasses.replace(ours, architecture=stock.architecture) == stock  # vLLM sees the same kind of model


def _stage(deploy, stage_id):
    return next(s for s in deploy.stages if s.stage_id == stage_id)


def test_overlay_through_vllm_omni_deploy_loader(monkeypatch):
    from vllm_omni.config.stage_config import load_deploy_config, merge_pipeline_deploy
    from vllm_omni.distributed.omni_connectors import get_stage_connector_config, load_omni_transfer_config
    from vllm_omni.config.stage_config import resolve_deploy_yaml
    from vllm_omni.model_executor.models.qwen3_tts.pipeline import QWEN3_TTS_PIPELINE

    monkeypatch.setenv("VLLM_OMNI_DEPLOY_DIR", str(DEPLOY_DIR))
    monkeypatch.setenv("CODE2WAV_SIDECAR_ADDRESS", "ipc:///run/test/sidecar.sock")
    ours, stock = load_deploy_config(OVERLAY), load_deploy_config(DEPLOY_DIR / "qwen3_tts.yaml")
    # inherited from the stock file
    assert (ours.model_runner, ours.async_chunk) == (stock.model_runner, stock.async_chunk)
    assert dataclasses.asdict(_stage(ours, 0)) == dataclasses.asdict(_stage(stock, 0))
    s1, stock1 = dataclasses.asdict(_stage(ours, 1)), dataclasses.asdict(_stage(stock, 1))
    changed = {k for k in s1 if s1[k] != stock1[k]}
    assert changed == {"engine_extras", "enforce_eager", "gpu_memory_utilization"}, changed
    assert s1["engine_extras"] == {**stock1["engine_extras"], "model_arch": ARCH_NAME}
    assert s1["enforce_eager"] is True
    # after the pipeline merge, stage 1 runs our architecture and stage 0 the stock talker
    stages = merge_pipeline_deploy(QWEN3_TTS_PIPELINE, ours)
    assert stages[1].yaml_engine_args["model_arch"] == ARCH_NAME
    assert stages[0].yaml_engine_args["model_arch"] == "Qwen3TTSTalkerForConditionalGeneration"
    # the connector extra the Code2Wav stage gets (OmniEngineArgs.create_model_config adds stage_id)
    transfer = load_omni_transfer_config(config_dict=resolve_deploy_yaml(OVERLAY))
    spec = next(iter(get_stage_connector_config(transfer, 1).values()))["spec"]
    extra = connector_extra({"name": spec["name"], "extra": {**spec["extra"], "stage_id": 1}})
    assert extra["sidecar_address"] == "ipc:///run/test/sidecar.sock" and extra["sidecar_mode"] == "exact"
    assert extra["codec_chunk_frames"] == 25 and extra["initial_codec_chunk_frames"] == 1  # the stock chunking


def test_model_from_overlay_returns_real_omni_output(tmp_path, sidecar, tiny_model, monkeypatch):
    from vllm_omni.config.stage_config import resolve_deploy_yaml
    from vllm_omni.distributed.omni_connectors import get_stage_connector_config, load_omni_transfer_config
    from vllm_omni.model_executor.models.output_templates import OmniOutput
    from vllm_omni.model_executor.models.registry import OmniModelRegistry
    from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
    from vllm_omni.worker_v2.omni_generation_model_runner import OmniGenerationModelRunner

    monkeypatch.setenv("VLLM_OMNI_DEPLOY_DIR", str(DEPLOY_DIR))
    monkeypatch.setenv("CODE2WAV_SIDECAR_ADDRESS", sidecar.address)
    register()
    transfer = load_omni_transfer_config(config_dict=resolve_deploy_yaml(OVERLAY))
    spec = next(iter(get_stage_connector_config(transfer, 1).values()))["spec"]
    model_config = SimpleNamespace(model=str(make_checkpoint(tmp_path)), model_impl="auto", convert_type="none",
                                   runner_type="generate",
                                   stage_connector_config={"name": spec["name"], "extra": {**spec["extra"],
                                                                                           "stage_id": 1}})
    cls, _ = OmniModelRegistry.resolve_model_cls([ARCH_NAME], model_config=model_config)
    model = cls(vllm_config=SimpleNamespace(model_config=model_config))
    codes = torch.randint(0, 64, (Q, 6), generator=torch.Generator().manual_seed(0))
    buffers = [payload("r1", codes[:, :2]), payload("r2", codes, finished=True)]
    out = model(input_ids=torch.zeros(32, dtype=torch.long), positions=torch.arange(32),
                model_intermediate_buffer=buffers, runtime_additional_information=buffers, seq_token_counts=[8, 24])
    assert isinstance(out, OmniOutput)
    # the v2 runner's own output code, and the v1 runner's
    pooled = OmniGenerationModelRunner._build_pooler_output(out, 2)
    assert torch.equal(pooled[1]["model_outputs"], out.multimodal_outputs["model_outputs"][1])
    assert int(pooled[0]["sr"]) == 24000
    fake_v1 = SimpleNamespace(model=model)
    _, mm = GPUGenerationModelRunner.extract_multimodal_outputs(fake_v1, out)
    assert mm is out.multimodal_outputs
    expected = torch.cat([tiny_model.module(codes[None, :, :2])[0, 0], tiny_model.module(codes[None])[0, 0]])
    got = torch.cat(mm["model_outputs"])
    assert torch.allclose(got, expected, atol=1e-4, rtol=0)
    model.on_requests_finished({sched_id("r1")})
    assert model.delegate.open_requests == []
    model.delegate.close()


# --------------------------------------------------------------------- parity with vLLM-Omni's own Code2Wav


@pytest.fixture(scope="module")
def upstream_code2wav(tmp_path_factory):
    """vLLM-Omni's ``Qwen3TTSCode2Wav`` (full-payload mode) on CPU with the tiny golden decoder's weights."""
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav

    root = make_checkpoint(tmp_path_factory.mktemp("upstream"))
    model = Qwen3TTSCode2Wav(vllm_config=SimpleNamespace(model_config=SimpleNamespace(model=str(root),
                                                                                       async_chunk=False)))
    weights = {k: v for k, v in load_file(str(root / "speech_tokenizer" / "model.safetensors")).items()
               if k.startswith("decoder.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not missing and not unexpected
    return model.eval()


def _decode_with(model, runner_cls, batch):
    """One runner step of full payloads through ``model`` (ours or upstream's: same forward contract)."""
    if runner_cls is V2Runner:
        counts = [max(1, int(p["codes"]["audio"].numel())) for _, p in batch]
        buffers = [p for _, p in batch]
        out = model(input_ids=torch.zeros(sum(counts), dtype=torch.long), positions=torch.arange(sum(counts)),
                    model_intermediate_buffer=buffers, runtime_additional_information=buffers, seq_token_counts=counts)
    else:
        ids = torch.cat([p["codes"]["audio"] for _, p in batch])
        out = model(input_ids=ids, positions=torch.arange(ids.numel()),
                    runtime_additional_information=[p for _, p in batch],
                    seq_token_counts=[int(p["codes"]["audio"].numel()) for _, p in batch],
                    request_ids=[s for s, _ in batch])
    return list(out.multimodal_outputs["model_outputs"])


@pytest.mark.parametrize("runner_cls", [V1Runner, V2Runner], ids=lambda r: r.name)
@pytest.mark.parametrize("chunk,left,frames", [(12, 5, [40, 33]), (300, 25, [700, 301])])
def test_window_mode_equals_upstream_code2wav(tmp_path, sidecar, upstream_code2wav, golden_cases, runner_cls,
                                              chunk, left, frames):
    """Full payloads (with reference codes as left context) decoded by vLLM-Omni's Code2Wav with
    ``decode_chunk_frames``/``decode_left_context_frames`` = (chunk, left) and by the delegate in window mode."""
    upstream_code2wav._decode_chunk_frames, upstream_code2wav._decode_left_context_frames = chunk, left
    ours = make_model(tmp_path, sidecar.address, sidecar_mode="window", decode_chunk_frames=chunk,
                      decode_left_context_frames=left)
    g = torch.Generator().manual_seed(chunk)
    batch = []
    for i, n in enumerate(frames):
        codes = golden_cases["codes"][i] if n == 40 else torch.randint(0, 64, (Q, n), generator=g)
        batch.append((sched_id(f"w{i}"), payload(f"w{i}", codes, left_context=7 * i, finished=True)))
    want = _decode_with(upstream_code2wav, runner_cls, batch)
    got = _decode_with(ours, runner_cls, batch)
    for i, n in enumerate(frames):
        assert got[i].shape == want[i].shape == ((n - 7 * i) * U,)
        print(f"window parity ({runner_cls.name}, chunk {chunk}, left {left}, {n} frames, {7 * i} reference): "
              f"max |ours - vLLM-Omni Qwen3TTSCode2Wav| = {(got[i] - want[i]).abs().max().item():.2e}")
        assert torch.allclose(got[i], want[i], atol=1e-5, rtol=0), (i, (got[i] - want[i]).abs().max())
    ours.delegate.close()


@pytest.mark.parametrize("runner_cls", [V1Runner, V2Runner], ids=lambda r: r.name)
def test_exact_mode_equals_upstream_one_shot_decoder(tmp_path, sidecar, upstream_code2wav, runner_cls):
    """Streaming in the connector's chunks, exact mode equals vLLM-Omni's decoder run once over all frames."""
    model = make_model(tmp_path, sidecar.address, sidecar_mode="exact")
    reqs, steps = streaming_scenario(seed=7)
    audio: dict[str, list[torch.Tensor]] = {}
    runner = runner_cls(model)
    for batch in steps:
        for (ext, _), wav in zip(batch, runner.step([(sched_id(ext), p) for ext, p in batch])):
            audio.setdefault(ext, []).append(wav)
    for ext, r in reqs.items():
        with torch.no_grad():
            want = upstream_code2wav.decoder(r["codes"][None]).reshape(-1)[r["ref"] * U:]
        got = torch.cat(audio[ext])
        print(f"exact parity ({runner_cls.name}, {ext}, chunks {r['bounds']}, {r['ref']} reference): "
              f"max |ours - vLLM-Omni decoder one-shot| = {(got - want).abs().max().item():.2e}")
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (ext, (got - want).abs().max())
    model.delegate.close()
