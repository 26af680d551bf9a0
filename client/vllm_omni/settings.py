"""Settings of the delegate Code2Wav stage: where the sidecar is and how to use it.

Read from the stage's connector ``extra`` (what ``vllm_config.model_config.stage_connector_config["extra"]``
holds: the ``connectors.<name>.extra`` block of the deploy YAML), then from environment variables (a deploy
YAML can set them per stage with ``env:``), then defaults. No vLLM import here.

=============================  ===============================  ==============================================
connector ``extra`` key         environment variable             meaning (default)
=============================  ===============================  ==============================================
``sidecar_address``             ``CODE2WAV_SIDECAR_ADDRESS``     ZeroMQ address (the one ``serve`` binds by default:
                                                                 ``code2wav.proto.address.default_address``);
                                                                 several, comma-separated, or ``dns://NAME:PORT``
                                                                 (a headless Service): a pool (``SidecarPool``)
``sidecar_mode``                ``CODE2WAV_SIDECAR_MODE``        ``exact`` (stateful, exact) or ``window`` (vLLM-Omni's
                                                                 stateless left-context decode)
``sidecar_left_context_frames``  ``CODE2WAV_SIDECAR_LEFT_CONTEXT_FRAMES``  window mode: frames of left context
                                                                 (``decode_left_context_frames`` if set, else 25)
``sidecar_window_chunk_frames``  ``CODE2WAV_SIDECAR_WINDOW_CHUNK_FRAMES``  window mode: longest chunk sent at once;
                                                                 longer payloads are split like upstream
                                                                 ``chunked_decode`` (``decode_chunk_frames``, else 300)
``sidecar_model``               ``CODE2WAV_SIDECAR_MODEL``       model name on the sidecar (its default)
``sidecar_timeout_s``           ``CODE2WAV_SIDECAR_TIMEOUT_S``   per call (30)
``sidecar_connect_timeout_s``   ``CODE2WAV_SIDECAR_CONNECT_TIMEOUT_S``  start-up handshake (10)
``sidecar_idle_ttl_s``          ``CODE2WAV_SIDECAR_IDLE_TTL_S``  forget (and abort) streams idle this long (600)
``sidecar_curve_server_key``     ``CODE2WAV_SIDECAR_CURVE_SERVER_KEY``  CurveZMQ: the sidecars' public key (the
                                                                 ``server.key`` file or its Z85 text); tcp:// only
``sidecar_curve_client_key_file``  ``CODE2WAV_SIDECAR_CURVE_CLIENT_KEY_FILE``  CurveZMQ: this runner's key pair
                                                                 (a ``.key_secret`` file) for an allow-list
=============================  ===============================  ==============================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from code2wav.proto.address import default_address

from ..discovery import parse_pool_address
from ..errors import InvalidArgument

__all__ = ["DEFAULT_SIDECAR_ADDRESS", "DelegateSettings", "connector_extra"]

DEFAULT_SIDECAR_ADDRESS = default_address(os.environ, os.getuid())
"""At import; ``DelegateSettings.from_sources`` applies the same rule to the environment it is given."""
_MODES = ("exact", "window")


def connector_extra(stage_connector_config: Any) -> dict[str, Any]:
    """The ``extra`` dict of a stage connector config (a dict with or without ``extra``, or an object)."""
    if stage_connector_config is None:
        return {}
    if isinstance(stage_connector_config, Mapping):
        extra = stage_connector_config.get("extra", stage_connector_config)
    else:
        extra = getattr(stage_connector_config, "extra", None)
    return dict(extra) if isinstance(extra, Mapping) else {}


@dataclass(frozen=True)
class DelegateSettings:
    address: str = field(default_factory=lambda: default_address(os.environ, os.getuid()))
    mode: str = "exact"
    left_context_frames: int = 25
    window_chunk_frames: int = 300
    model: str | None = None
    timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    idle_ttl_s: float = 600.0
    curve_server_key: str | None = None
    curve_client_key_file: str | None = None

    @property
    def client_options(self) -> dict[str, Any]:
        """What the delegate's ``SidecarPool`` takes besides the address."""
        return {"timeout_s": self.timeout_s, "connect_timeout_s": self.connect_timeout_s,
                "curve_server_key": self.curve_server_key, "curve_client_key_file": self.curve_client_key_file}

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"sidecar_mode must be one of {_MODES}, got {self.mode!r}")
        try:
            parse_pool_address(self.address)
        except InvalidArgument as exc:
            raise ValueError(f"sidecar_address must be a ZeroMQ address like ipc:///path or tcp://host:port, several "
                             f"of them comma-separated, or dns://NAME:PORT; got {self.address!r} ({exc.message})"
                             ) from None
        if self.left_context_frames < 0 or self.window_chunk_frames <= 0:
            raise ValueError(f"sidecar_left_context_frames must be >= 0 and sidecar_window_chunk_frames > 0, got "
                             f"{self.left_context_frames} and {self.window_chunk_frames}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0 or self.idle_ttl_s <= 0:
            raise ValueError("sidecar timeouts must be > 0")

    @classmethod
    def from_sources(cls, extra: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None) -> DelegateSettings:
        """``extra`` wins over ``environ`` (default ``os.environ``), which wins over the defaults."""
        extra = dict(extra or {})
        env = os.environ if environ is None else environ

        def pick(key: str, env_key: str, default: Any, kind: type) -> Any:
            value = extra.get(key)
            source = f"connector extra {key}"
            if value is None or value == "":
                value, source = env.get(env_key), f"${env_key}"
            if value is None or value == "":
                return default
            try:
                return kind(value)
            except (TypeError, ValueError):
                raise ValueError(f"{source}={value!r} is not a valid {kind.__name__}") from None

        left_default = extra.get("decode_left_context_frames")
        chunk_default = extra.get("decode_chunk_frames")
        model = pick("sidecar_model", "CODE2WAV_SIDECAR_MODEL", None, str)
        return cls(
            address=pick("sidecar_address", "CODE2WAV_SIDECAR_ADDRESS", default_address(env, os.getuid()), str),
            mode=pick("sidecar_mode", "CODE2WAV_SIDECAR_MODE", "exact", str).strip().lower(),
            left_context_frames=pick("sidecar_left_context_frames", "CODE2WAV_SIDECAR_LEFT_CONTEXT_FRAMES",
                                     int(left_default) if left_default is not None else 25, int),
            window_chunk_frames=pick("sidecar_window_chunk_frames", "CODE2WAV_SIDECAR_WINDOW_CHUNK_FRAMES",
                                     int(chunk_default) if chunk_default is not None else 300, int),
            model=model or None,
            timeout_s=pick("sidecar_timeout_s", "CODE2WAV_SIDECAR_TIMEOUT_S", 30.0, float),
            connect_timeout_s=pick("sidecar_connect_timeout_s", "CODE2WAV_SIDECAR_CONNECT_TIMEOUT_S", 10.0, float),
            idle_ttl_s=pick("sidecar_idle_ttl_s", "CODE2WAV_SIDECAR_IDLE_TTL_S", 600.0, float),
            curve_server_key=pick("sidecar_curve_server_key", "CODE2WAV_SIDECAR_CURVE_SERVER_KEY", None, str),
            curve_client_key_file=pick("sidecar_curve_client_key_file", "CODE2WAV_SIDECAR_CURVE_CLIENT_KEY_FILE",
                                       None, str),
        )
