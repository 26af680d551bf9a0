"""The ``vllm-omni-stock`` baseline against the REAL vLLM-Omni 0.30 package (skipped without it).

- built from vLLM-Omni's shipped deploy file, with our decoder's weights: its one-shot decoder equals ours;
- its own streaming path (state cache, 1 then 25 frames) equals one-shot inside the sliding window and drifts after;
- the vLLM import shim: a subprocess with every ``vllm`` import blocked builds the same baseline through the shim
  and produces the same audio as this process with the real vLLM;
- the shim's weight loader maps and rejects names like vLLM's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed (bash .ci/install-vllm installs vllm==0.30.0 "
                    "vllm-omni==0.30.0 into the test environment)")

from code2wav.loadgen import stock_shim  # noqa: E402
from code2wav.loadgen.stock import build_stock, deploy_settings  # noqa: E402
from code2wav.loadgen.traffic import chunk_sizes, synthetic_codes  # noqa: E402
from code2wav.sidecar.models import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "golden" / "tiny_a"
NUM_FRAMES = 40
BLOCK_VLLM = textwrap.dedent("""
    import importlib.abc, sys
    class BlockVllm(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "vllm" or name.startswith("vllm."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
    sys.meta_path.insert(0, BlockVllm())
""")


@pytest.fixture(scope="module")
def tiny():
    return load_model(str(TINY), torch.device("cpu"))


@pytest.fixture(scope="module")
def stock(tiny):
    return build_stock(tiny)


@pytest.fixture(scope="module")
def codes(tiny):
    return synthetic_codes(tiny.num_quantizers, NUM_FRAMES, tiny.codebook_size, seed=11)


def test_configured_by_the_shipped_deploy_file(stock):
    settings = deploy_settings()
    extra = settings["extra"]
    assert settings["path"].endswith("vllm_omni/deploy/qwen3_tts.yaml")
    assert (extra["codec_chunk_frames"], extra["codec_left_context_frames"], extra["initial_codec_chunk_frames"],
            extra["decode_batch_max_size"]) == (25, 72, 1, 4), extra
    assert settings["async_chunk"] is True and settings["enforce_eager"] is False
    # ... and the built module took them (its own load_weights read the connector extra).
    assert stock.module._decode_batch_max_size == 4
    assert stock.module.decoder._incremental_chunk_frames == 25
    assert stock.module.decoder._initial_codec_chunk_frames == 1
    assert stock.module._async_chunk is True
    assert stock.vllm_shim is False  # this process has the real vLLM
    assert stock.graphs is False  # CPU: no CUDA graphs


def test_one_shot_equals_our_decoder(tiny, stock, codes):
    with torch.no_grad():
        ours = tiny.module(codes[None])[0, 0]  # [T * U]
        theirs = stock.module.decoder(codes[None])[0, 0]  # vLLM-Omni's Qwen3TTSTokenizerV2Decoder, same weights
    err = (ours - theirs).abs().max().item()
    print(f"one-shot: max |ours - vLLM-Omni decoder| = {err:.2e}")
    assert theirs.shape == ours.shape
    assert err < 1e-5


def test_stock_streaming_is_exact_inside_the_window_then_drifts(tiny, stock, codes):
    with torch.no_grad():
        want = tiny.module(codes[None])[0, 0]
    got = stock.stream(codes, chunk_sizes(NUM_FRAMES, 1, 25))
    split = tiny.module.cfg.sliding_window * tiny.samples_per_frame
    inside = (got[:split] - want[:split]).abs().max().item()
    after = (got[split:] - want[split:]).abs().max().item()
    print(f"stock streaming (tiny, window {tiny.module.cfg.sliding_window}): max abs {inside:.2e} inside the "
          f"window, {after:.2e} after")
    assert got.shape == want.shape
    assert inside < 1e-5
    assert after > 1e-3  # it keeps only a window of frames; this is the drift the sidecar's exact mode removes
    assert not stock.module._decoder_state_cache  # the finished request's state was freed


def test_shim_gives_the_same_audio_as_real_vllm(tmp_path, tiny, stock, codes):
    sizes = chunk_sizes(NUM_FRAMES - 3, 1, 25)
    want = stock.stream(codes, sizes, ref_frames=3, request_id="real")
    codes_path, out_path = tmp_path / "codes.json", tmp_path / "audio.json"
    codes_path.write_bytes(json.dumps(codes.tolist()).encode())
    script = BLOCK_VLLM + textwrap.dedent(f"""
        import json, torch
        from code2wav.loadgen.stock import build_stock
        from code2wav.sidecar.models import load_model
        model = load_model({str(TINY)!r}, torch.device("cpu"))
        stock = build_stock(model)
        codes = torch.tensor(json.loads(open({str(codes_path)!r}).read()))
        with torch.no_grad():
            wav = stock.stream(codes, {sizes!r}, ref_frames=3, request_id="shim")
        import vllm
        json.dump({{"vllm_shim": stock.vllm_shim, "vllm_module": type(vllm).__name__, "audio": wav.tolist()}},
                  open({str(out_path)!r}, "w"))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out_path.read_text())
    got = torch.tensor(result["audio"])
    err = (got - want).abs().max().item()
    print(f"shim vs real vLLM: vllm_shim={result['vllm_shim']}, max abs diff {err:.2e} over {got.numel()} samples")
    assert result["vllm_shim"] is True and result["vllm_module"] == "_ShimModule"
    assert got.shape == want.shape
    assert err <= 1e-6


def test_shim_weight_loader_maps_and_rejects_names(tmp_path):
    mapper = stock_shim.WeightsMapper(orig_to_new_prefix={"encoder.": None, "old.": "new."})
    assert mapper.map_name("encoder.x") is None
    assert mapper.map_name("old.w") == "new.w"
    assert mapper.map_name("decoder.w") == "decoder.w"

    module = torch.nn.Module()
    module.new = torch.nn.Linear(2, 3)
    weight = torch.arange(6.0).reshape(3, 2)
    loaded = stock_shim.AutoWeightsLoader(module).load_weights(
        iter([("old.weight", weight), ("encoder.skip", torch.zeros(1))]), mapper=mapper)
    assert loaded == {"new.weight"}
    assert torch.equal(module.new.weight, weight)
    with pytest.raises(ValueError, match="no parameter or buffer named 'nope'"):
        stock_shim.AutoWeightsLoader(module).load_weights(iter([("nope", weight)]))
    with pytest.raises(ValueError, match="checkpoint \\(2, 3\\) vs model \\(3, 2\\)"):
        stock_shim.AutoWeightsLoader(module).load_weights(iter([("new.weight", weight.T.contiguous())]))


def test_bench_phase_skips_cleanly_without_vllm_omni(tmp_path):
    script = textwrap.dedent("""
        import importlib.abc, sys
        class BlockOmni(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("vllm", "vllm_omni"):
                    raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        sys.meta_path.insert(0, BlockOmni())
        import json
        from code2wav.loadgen.bench import build_parser
        from code2wav.loadgen.stock_bench import run_stock_phase
        print(json.dumps(run_stock_phase(build_parser().parse_args([]), model=None)))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vllm-omni-stock: SKIPPED: vllm-omni is not importable" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "pip install vllm-omni==0.30.0" in result["skipped"]
