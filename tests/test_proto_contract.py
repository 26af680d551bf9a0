"""The welcome message's input contract and ``open_stream.options`` on the wire (proto only, no server)."""

from __future__ import annotations

import msgpack
import pytest

from code2wav.proto import (Limits, ModelInfo, OpenStream, ProtocolError, StreamOptionInfo, Welcome,
                            decode_client_message, decode_server_message, encode)

LATENTS = ModelInfo("voxcpm2-audiovae", 64, None, 1920, 48000, ("exact", "window"), "bfloat16", "cuda:0",
                    family="voxcpm2_audiovae", input_kind="latents", input_dtypes=("float32",), input_channels=64,
                    input_range=None, stream_options=(StreamOptionInfo("sr_cond", 0, 3, 3),))
CODES = ModelInfo("qwen3-tts-12hz", 16, 2048, 1920, 24000, ("exact",), "float32", "cpu", family="qwen3_tts",
                  input_channels=16, input_range=(0, 2048))


def _welcome(*models: ModelInfo) -> Welcome:
    return Welcome(request_id=1, version=1, server_id="s", boot_epoch="e", models=models,
                   default_model=models[0].name, limits=Limits())


def test_contract_fields_round_trip_and_derive():
    msg = _welcome(LATENTS, CODES)
    decoded = decode_server_message(encode(msg))
    assert decoded == msg
    latents, codes = decoded.models
    assert (latents.channels, latents.valid_range, latents.stream_options[0].default) == (64, None, 3)
    assert (codes.channels, codes.valid_range, codes.input_dtypes) == (16, (0, 2048), ("int16", "int32", "int64"))


def test_a_welcome_from_an_older_server_reads_as_a_codes_model():
    wire = _welcome(CODES).to_wire()
    for key in ("family", "input_kind", "input_dtypes", "input_channels", "input_range", "stream_options"):
        del wire["models"][0][key]
    info = decode_server_message([msgpack.packb(wire)]).models[0]
    assert (info.input_kind, info.channels, info.valid_range, info.stream_options) == ("codes", 16, (0, 2048), ())


def test_bad_contract_fields_are_typed_errors():
    wire = _welcome(LATENTS).to_wire()
    wire["models"][0]["stream_options"] = [{"name": "sr_cond", "low": 0, "high": "3", "default": 0}]
    with pytest.raises(ProtocolError, match=r"stream_options\[0\]\.high must be an integer"):
        decode_server_message([msgpack.packb(wire)])
    wire = _welcome(CODES).to_wire()
    wire["models"][0]["input_range"] = [0]
    with pytest.raises(ProtocolError, match="input_range must be \\[low, high\\]"):
        decode_server_message([msgpack.packb(wire)])


def test_open_stream_options_round_trip_and_are_checked():
    msg = OpenStream(3, "s", None, "exact", 0, {"sr_cond": 2})
    assert decode_client_message(encode(msg)) == msg
    assert "options" not in OpenStream(4, "t").to_wire()  # absent when empty: older servers accept it
    wire = msg.to_wire()
    wire["options"] = {"sr_cond": "2"}
    with pytest.raises(ProtocolError, match="open_stream.options.sr_cond must be an integer"):
        decode_client_message([msgpack.packb(wire)])
    wire["options"] = {f"o{i}": 1 for i in range(17)}
    with pytest.raises(ProtocolError, match="has 17 entries; the limit is 16"):
        decode_client_message([msgpack.packb(wire)])
