"""The connected clients (sans-IO): handshake, who owns each session, when each was last heard from.

A session is keyed by the connection's routing id and bound to its owner at ``hello`` (``auth.SessionOwners``: a
CURVE key, or the per-session secret the ``welcome`` carries). A ``hello`` on a routing id that has a session must
come from its owner, and replaces the session (the old one's streams are freed); any other message from another
owner is refused and changes nothing.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Callable

from code2wav import proto
from code2wav.proto import ErrorCode

from .auth import SessionOwners, new_session_secret
from .connlog import ConnLog
from .metrics import Metrics
from .replies import Outbox

log = logging.getLogger(__name__)


@dataclass
class ClientSession:
    client_id: str
    last_seen_s: float = 0.0
    secret: str = ""  # sent in the welcome; a re-handshake on this routing id must present it (auth.py)
    owner: str | None = None  # CURVE: the client's public key (ZAP user id); every message must carry it


@dataclass(frozen=True)
class WelcomeTerms:
    """What every ``welcome`` says besides the session's own secret (built once at start-up)."""

    models: tuple[proto.ModelInfo, ...]
    default_model: str
    limits: proto.Limits
    heartbeat_interval_s: float
    capabilities: dict


class ClientDirectory:
    def __init__(self, terms: WelcomeTerms, out: Outbox, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.terms = terms
        self.out = out
        self.metrics = metrics
        self.clock = clock
        self.boot_epoch = uuid.uuid4().hex
        self.server_id = f"code2wav-sidecar-{self.boot_epoch[:8]}"
        self.sessions: dict[bytes, ClientSession] = {}
        self.owners = SessionOwners(metrics)
        self.connlog = ConnLog(log)  # connect/disconnect lines, rate-limited
        self.load_now: Callable[[], proto.Load | None] = lambda: None  # the server's load, for the welcome

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, identity: bytes) -> ClientSession | None:
        return self.sessions.get(identity)

    def may_act(self, identity: bytes, session: ClientSession, request_id: int | None, user_id: str | None) -> bool:
        """Whether a message on ``identity`` comes from its session's owner (if not: refused, answered, logged
        once); the owner's messages also count as signs of life."""
        if not self.owners.owns(session.owner, user_id):
            self.owners.refused(identity, session.client_id, "a message from a CURVE key that does not own the "
                                                             "session")
            self.out.error(identity, request_id, ErrorCode.INVALID_ARGUMENT, "this routing id has a session owned "
                           "by another CURVE client key; connect with a fresh routing id")
            return False
        session.last_seen_s = self.clock()
        return True

    def hello(self, identity: bytes, msg: proto.Hello, user_id: str | None, drop: Callable[[bytes, str], None]
              ) -> None:
        """A handshake: a new session, or (from its owner) a replacement for the routing id's session, whose
        streams ``drop`` frees; answered ``welcome``."""
        old = self.sessions.get(identity)
        if old is not None:
            why = self.owners.rehandshake_refusal(old.owner, old.secret, user_id, msg.session_secret)
            if why is not None:  # the session stays as it is
                self.owners.refused(identity, msg.client_id, why)
                return self.out.error(identity, msg.request_id, ErrorCode.INVALID_ARGUMENT, why)
            drop(identity, "rehandshake")
        secret = new_session_secret()
        self.sessions[identity] = ClientSession(msg.client_id, last_seen_s=self.clock(), secret=secret, owner=user_id)
        self.metrics.clients.set(len(self.sessions))
        self.connlog.connected(msg.client_id, len(self.sessions))
        terms = self.terms
        self.out.send(identity, proto.Welcome(
            request_id=msg.request_id, version=proto.PROTOCOL_VERSION, server_id=self.server_id,
            boot_epoch=self.boot_epoch, models=terms.models, default_model=terms.default_model, limits=terms.limits,
            heartbeat_interval_s=terms.heartbeat_interval_s, capabilities=terms.capabilities, session_secret=secret,
            load=self.load_now()))

    def remove(self, identity: bytes, reason: str, num_streams: int) -> ClientSession | None:
        """Forget ``identity``'s session (bye, re-handshake, silence); logged (rate-limited) with its stream count."""
        session = self.sessions.pop(identity, None)
        if session is not None:
            self.connlog.disconnected(session.client_id, reason, num_streams, len(self.sessions))
            self.metrics.clients.set(len(self.sessions))
        return session
