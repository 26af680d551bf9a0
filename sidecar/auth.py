"""Who may use the sidecar, and who owns a session.

Two mechanisms (policy in ``SessionOwners``, the ZAP mechanism in ``ClientAuth``):

- **Client allow-list (CurveZMQ only).** With CURVE, a ZAP handler thread (``zmq.auth``) checks each new
  connection's client public key against a folder of public key files (``security.curve_allowed_clients_dir``,
  the ``*.key`` files ``code2wav-sidecar keygen`` or ``zmq.auth.create_certificates`` write), reloaded on SIGHUP.
  So a leaked server key alone lets nobody in. Without a folder every key is accepted (the CURVE handshake still
  needs the server's public key). Either way the handler names the client's key as the connection's ZAP user id,
  which every message then carries (the frame's ``User-Id`` property).
- **Session owner.** A session is bound to its owner at ``hello``: with CURVE to the client's public key (every
  later message on that routing id must carry it); without CURVE to a random per-session secret sent in the
  ``welcome``, which a re-handshake (``hello`` on a routing id that has a session) must present. A refused
  client is counted (``code2wav_sidecar_auth_refused_total{reason}``) and logged once.

Keys never reach the log: a refused client key is logged by its fingerprint (``key_fingerprint``: the first 8 hex
digits of the SHA-256 of its 32 raw bytes), and the ZAP handler's own logger (pyzmq's, which prints client keys at
debug level) passes through ``RedactKeys``, which writes every key-shaped argument as its fingerprint.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from .metrics import Metrics

log = logging.getLogger(__name__)

MAX_LOGGED_REFUSALS = 4096
"""Distinct refused keys or routing ids remembered for log-once (then the memory starts over)."""


def key_fingerprint(public_key: bytes) -> str:
    """What the log shows of a CURVE public key (32 raw bytes): the first 8 hex digits of its SHA-256. An operator
    finds the key file by computing the same over the ``*.key`` files (docs/deployment.md)."""
    return hashlib.sha256(public_key).hexdigest()[:8]


Z85_KEY_LEN = 40
"""Characters of a CURVE key in Z85 text (32 bytes)."""


def _redacted(value):
    """``value`` with every CURVE-key-shaped part (32 raw bytes, or 40 characters of Z85) as ``key:<fingerprint>``."""
    if isinstance(value, (list, tuple)):
        return type(value)(_redacted(v) for v in value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) == 32:
            return f"key:{key_fingerprint(raw)}"
        value = raw.decode("latin-1")
    if isinstance(value, str) and len(value) == Z85_KEY_LEN:
        try:
            return f"key:{key_fingerprint(z85.decode(value.encode('latin-1')))}"
        except (ValueError, KeyError, IndexError, UnicodeEncodeError):  # not Z85 after all
            return value
    return value


class RedactKeys(logging.Filter):
    """A filter for a logger that may be handed client keys (pyzmq's ZAP handler): key-shaped arguments become
    their fingerprints before the record is formatted."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted(arg) for arg in record.args)
        elif isinstance(record.msg, (bytes, str)):
            record.msg = _redacted(record.msg)
        return True


class _LogOnce:
    """Log a refusal the first time a key is seen (bounded memory)."""

    def __init__(self) -> None:
        self._seen: set = set()

    def first(self, key) -> bool:
        if key in self._seen:
            return False
        if len(self._seen) >= MAX_LOGGED_REFUSALS:
            self._seen.clear()
        self._seen.add(key)
        return True


def load_allowed_keys(folder: str | Path) -> dict[bytes, bool]:
    """The z85 client public keys of the ``*.key`` files in ``folder`` (raises when it is not a folder)."""
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"security.curve_allowed_clients_dir: {path} is not a folder of client public "
                                "key files (*.key, from `code2wav-sidecar keygen`)")
    return zmq.auth.load_certificates(str(path))


class ClientAuth(ThreadAuthenticator):
    """The ZAP handler: CURVE clients whose key is in the allow-list (or any key without one)."""

    def __init__(self, ctx: zmq.Context, allowed_dir: str | None, metrics: Metrics) -> None:
        zap_log = logging.getLogger(__name__ + ".zap")
        if not any(isinstance(f, RedactKeys) for f in zap_log.filters):
            zap_log.addFilter(RedactKeys())
        super().__init__(ctx, log=zap_log)
        self.allowed_dir = allowed_dir
        self.metrics = metrics
        self._logged = _LogOnce()

    def start(self) -> None:
        super().start()
        self.reload()

    def reload(self) -> None:
        """(Re)read the allow-list folder (SIGHUP). A folder that cannot be read keeps the previous list."""
        if self.allowed_dir is None:
            self.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
            log.info("CURVE clients: any key is accepted (no security.curve_allowed_clients_dir)")
            return
        try:
            keys = load_allowed_keys(self.allowed_dir)
        except (OSError, ValueError) as exc:
            log.error("CURVE allow-list not reloaded (the previous one stays): %s", exc)
            return
        self.certs["*"] = keys
        self.allow_any = False
        log.info("CURVE clients: %d allowed keys from %s", len(keys), self.allowed_dir)

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        if not allowed:  # (ZAP thread) counted always, logged once per key
            self.metrics.auth_refused.labels(reason="unknown_key").inc()
            if self._logged.first(client_key):
                log.warning("refused a CURVE client whose public key (fingerprint %s) is not in %s (logged once "
                            "per key)", key_fingerprint(client_key), self.allowed_dir)
        return allowed, reason


def start_client_auth(ctx: zmq.Context, security: str, allowed_dir: str | None, metrics: Metrics
                      ) -> ClientAuth | None:
    """Start the ZAP handler on ``ctx`` before the socket binds; None unless the transport uses CURVE."""
    if security != "curve":
        if allowed_dir is not None:
            log.warning("security.curve_allowed_clients_dir is ignored: the socket does not use CurveZMQ")
        return None
    if allowed_dir is not None:
        load_allowed_keys(allowed_dir)  # fail fast on a missing folder
    auth = ClientAuth(ctx, allowed_dir, metrics)
    auth.start()
    return auth


def new_session_secret() -> str:
    return secrets.token_hex(16)


class SessionOwners:
    """Policy: may this connection act on (or re-handshake over) the session of its routing id?"""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._logged = _LogOnce()

    def owns(self, owner: str | None, user_id: str | None) -> bool:
        """Every message: with CURVE the session's owner key must be the connection's (without, None == None)."""
        return owner == user_id

    def rehandshake_refusal(self, owner: str | None, secret: str, user_id: str | None,
                            presented_secret: str | None) -> str | None:
        """Why a ``hello`` on a routing id that has a session may not replace it (None: it may)."""
        if owner is not None or user_id is not None:
            if owner == user_id:
                return None
            return ("this routing id has a session owned by another CURVE client key; connect with a fresh "
                    "routing id")
        if presented_secret is not None and hmac.compare_digest(presented_secret.encode(), secret.encode()):
            return None
        return ("this routing id has a session: a re-handshake must present its session_secret (from the "
                "welcome); a new client must use a fresh routing id")

    def refused(self, identity: bytes, client_id: str, why: str) -> None:
        self.metrics.auth_refused.labels(reason="session_owner").inc()
        if self._logged.first(identity):
            log.warning("refused client '%s' on routing id %s: %s (logged once per routing id)", client_id,
                        identity.hex(), why)
