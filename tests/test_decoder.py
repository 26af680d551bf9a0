"""The decoder reproduces the upstream golden vectors and has the shipped checkpoint layout."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import GOLDEN, TINY
from code2wav.sidecar.models.qwen3_tts import SHIPPED, CheckpointError, DecoderConfig, Qwen3TTSDecoder, load_folder

TOL = 1e-5


def test_tiny_golden_full(tiny_model, golden_cases):
    with torch.no_grad():
        out = tiny_model.module(golden_cases["codes"])  # [2, 1, 1920]
    assert out.shape == golden_cases["full"].shape
    assert out.dtype == torch.float32
    assert (out - golden_cases["full"]).abs().max().item() <= TOL


def test_default_model_layout_matches_manifest():
    manifest = json.loads((GOLDEN / "qwen3_tts_12hz_decoder_manifest.json").read_text())
    model = Qwen3TTSDecoder(SHIPPED)  # parameters only; no need for random init here
    ours = {"decoder." + k: list(v.shape) for k, v in model.decoder.state_dict().items()}
    assert ours == manifest["tensors"]
    assert sum(v.numel() for v in model.decoder.state_dict().values()) == manifest["num_parameters"]
    assert SHIPPED.samples_per_frame == manifest["samples_per_frame"]
    for key, value in manifest["decoder_config"].items():
        if hasattr(SHIPPED, key):
            got = getattr(SHIPPED, key)
            assert (list(got) if isinstance(got, tuple) else got) == value, key


def _copy_tiny(tmp_path):
    folder = tmp_path / "speech_tokenizer"
    shutil.copytree(TINY, folder)
    return folder


def test_missing_tensor_is_named(tmp_path):
    folder = _copy_tiny(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["decoder.pre_conv.conv.bias"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="decoder.pre_conv.conv.bias"):
        load_folder(folder)


def test_unexpected_tensor_is_named_and_encoder_skipped(tmp_path):
    folder = _copy_tiny(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    assert any(k.startswith("encoder.") for k in tensors)  # skipped silently
    tensors["decoder.pre_conv.extra"] = torch.zeros(3)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="decoder.pre_conv.extra"):
        load_folder(folder)


def test_shape_mismatch_is_named(tmp_path):
    folder = _copy_tiny(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["decoder.pre_conv.conv.bias"] = torch.zeros(41)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"decoder.pre_conv.conv.bias: file \(41,\)"):
        load_folder(folder)


def test_bad_config_names_field(tmp_path):
    folder = _copy_tiny(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["decoder_config"]["num_hiden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="num_hiden_layers"):
        load_folder(folder)


def test_random_default_weights_depend_on_codes():
    from code2wav.sidecar.models.qwen3_tts import random_model

    cfg = DecoderConfig(num_hidden_layers=1, decoder_dim=96, latent_dim=64, codebook_dim=64, hidden_size=32,
                        intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                        codebook_size=64)
    model = random_model(cfg, seed=3)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 64, (1, 16, 6), generator=gen)
    b = a.clone()
    b[0, 0, 2] = (b[0, 0, 2] + 1) % 64
    with torch.no_grad():
        wa, wb = model(a), model(b)
    spf = cfg.samples_per_frame
    assert torch.equal(wa[..., : 2 * spf], wb[..., : 2 * spf])  # causal: earlier frames unchanged
    assert (wa[..., 2 * spf:] - wb[..., 2 * spf:]).abs().max() > 1e-4  # the changed code is heard
    assert 0.01 < wa.std().item() < 0.9  # audible, not saturated
    again = random_model(cfg, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))  # seeded


def test_bfloat16_runs_and_outputs_float32(golden_cases):
    from code2wav.sidecar.models import load_model

    model = load_model(str(TINY), torch.device("cpu"), "bfloat16")
    with torch.no_grad():
        out = model.module(golden_cases["codes"])
    assert out.dtype == torch.float32
    # bf16 weights change the numbers; it must still be the same signal, roughly
    assert (out - golden_cases["full"]).abs().mean().item() < 0.05


@pytest.mark.parametrize("config", ["tiny", "shipped"])
@pytest.mark.parametrize("rope_kernel", [False, True])
def test_few_kernel_transformer_equals_the_plain_form(config, rope_kernel):
    """The transformer's two forms (module docstring of ``transformer.py``): the few-kernel one, which the sidecar's
    steps run (autograd off), against the checkpoint's modules one by one (autograd on, as under training or
    ``torch.compile``), over three chunks that carry the key/value cache, rows at different positions, the second
    row right-padded. Float32: the same maths, summed in another order. ``rope_kernel``: the rotary embedding and
    cache update as one op (``kernels/rope_cache.py``), the layers' shared inputs as one op
    (``kernels/window_inputs.py``), each residual add with the norm after it and the MLP's gate as one op each
    (``kernels/layer_glue.py``): their CPU implementations here, their kernels in ``tests/test_rope_cache.py``."""
    from code2wav.sidecar.models.qwen3_tts.loader import random_model
    from code2wav.sidecar.models.streaming import StreamContext

    model = load_folder(TINY)[0] if config == "tiny" else random_model(SHIPPED, seed=3)
    pre = model.decoder.pre_transformer
    switched = [sub for sub in pre.modules() if hasattr(sub, "kernels_on")]
    assert len(switched) == 2 * len(pre.layers) + 1  # each layer's attention and MLP, and the transformer
    for sub in switched:
        sub.kernels_on = rope_kernel
    layout = {k: v for k, v in model.state_layout().items() if k.startswith("pre_transformer")}
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn((2, *shape), generator=gen) for k, shape in layout.items()}
    plain_state, few_state = dict(state), dict(state)
    positions = torch.tensor([3, 40])  # row 0 early (part of its cache lies before position 0), row 1 well in
    for num_new, valid in [(4, [4, 2]), (1, [1, 1]), (7, [5, 7])]:
        x = torch.randn((2, num_new, pre.input_proj.in_features), generator=gen)  # [B, T, latent]
        lengths = torch.tensor(valid)
        with torch.enable_grad():
            plain_ctx = StreamContext(plain_state)
            plain = pre(x, positions, lengths, plain_ctx).detach()  # [B, T, latent]
        with torch.inference_mode():
            few_ctx = StreamContext(few_state)
            few = pre(x, positions, lengths, few_ctx)  # [B, T, latent]
        for b in range(2):
            assert (few[b, :valid[b]] - plain[b, :valid[b]]).abs().max().item() <= 1e-5 * max(1.0, plain.abs().max())
        plain_state = {k: v.detach() for k, v in plain_ctx.state_out.items()}
        few_state = dict(few_ctx.state_out)
        assert set(few_state) == set(layout)
        for k in layout:
            assert (few_state[k] - plain_state[k]).abs().max().item() <= 1e-5, k
        positions = positions + lengths


def test_stacked_weights_follow_their_sources():
    """``StackedWeights`` (q/k/v and gate/up as one GEMM): the same tensor while the sources are unchanged, and
    rebuilt after an in-place write into one of them (a checkpoint loaded into the module) or a cast."""
    from code2wav.sidecar.models.qwen3_tts.transformer import StackedWeights

    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)
    stacked = StackedWeights([a, b])
    with torch.no_grad():
        first, bias = stacked.get()
        assert torch.equal(first, torch.cat([a.weight, b.weight])) and torch.equal(bias, torch.cat([a.bias, b.bias]))
        assert stacked.get()[0] is first  # cached
        b.weight.mul_(2.0)
        assert torch.equal(stacked.get()[0][3:], b.weight)
        a.double()
        again, _ = stacked.get()
        assert again.dtype == torch.float64 and torch.equal(again[:3], a.weight)
