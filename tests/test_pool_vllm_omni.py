"""The vLLM-Omni delegate over a pool: ``sidecar_address`` naming two sidecars (comma-separated) spreads the
requests' streams over both, and every request's audio is what one sidecar gives (``test_vllm_omni.py``'s
scenario, on real sidecar processes)."""

from __future__ import annotations

import pytest
import torch

from conftest import start_sidecar
from test_vllm_omni import (HAVE_VLLM_OMNI, RUNNERS, U, LocalOmniOutput, make_model, metric, model_module, one_shot,
                            run_streaming, streaming_scenario)


@pytest.fixture(autouse=True)
def _omni_output(monkeypatch):
    """vLLM-Omni's output type, or test_vllm_omni's stand-in when it is not installed."""
    if not HAVE_VLLM_OMNI:
        monkeypatch.setattr(model_module, "omni_output_type", lambda: LocalOmniOutput)


@pytest.mark.parametrize("runner_cls", RUNNERS[:1], ids=lambda r: r.name)
def test_the_delegate_spreads_requests_over_the_pool(tmp_path, tiny_model, runner_cls):
    running = []
    for index in range(2):
        (tmp_path / f"s{index}").mkdir()
        running.append(start_sidecar(tmp_path / f"s{index}"))
    try:
        model = make_model(tmp_path, ",".join(sidecar.address for sidecar in running), sidecar_mode="exact")
        reqs, steps = streaming_scenario()
        audio, _ = run_streaming(runner_cls(model), steps, native=True)
        for ext, r in reqs.items():
            expected = one_shot(tiny_model, r["codes"])[r["ref"] * U:]
            got = torch.cat(audio[ext])
            assert torch.allclose(got, expected, atol=1e-4, rtol=0), (ext, (got - expected).abs().max())
        opened = [metric(sidecar.scrape(), "streams_opened_total") for sidecar in running]
        assert sorted(opened) == [1, 2]  # three requests, both sidecars used
        assert [metric(sidecar.scrape(), "active_streams") for sidecar in running] == [0, 0]
        model.delegate.close()
    finally:
        for sidecar in running:
            sidecar.stop()


def test_pool_addresses_in_the_settings():
    from code2wav.client.vllm_omni.settings import DelegateSettings

    assert DelegateSettings.from_sources({"sidecar_address": "dns://sidecars.tts.svc:5555"}, {}).address == (
        "dns://sidecars.tts.svc:5555")
    assert DelegateSettings.from_sources({}, {"CODE2WAV_SIDECAR_ADDRESS": "ipc:///a.sock,ipc:///b.sock"}).address == (
        "ipc:///a.sock,ipc:///b.sock")
    keys = {"CODE2WAV_SIDECAR_CURVE_SERVER_KEY": "/etc/code2wav/keys/server.key",
            "CODE2WAV_SIDECAR_CURVE_CLIENT_KEY_FILE": "/etc/code2wav/client/client.key_secret"}
    options = DelegateSettings.from_sources({"sidecar_timeout_s": 7}, keys).client_options
    assert options == {"timeout_s": 7.0, "connect_timeout_s": 10.0, "curve_server_key": "/etc/code2wav/keys/server.key",
                       "curve_client_key_file": "/etc/code2wav/client/client.key_secret"}
    with pytest.raises(ValueError, match="dns://NAME:PORT"):
        DelegateSettings.from_sources({"sidecar_address": "dns://no-port"}, {})
