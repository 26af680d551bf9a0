"""Which sidecars a pool spans: a fixed list of addresses, or a DNS name re-resolved now and then (a Kubernetes
headless Service: one A/AAAA record per ready sidecar pod; Kubernetes is the registry, not us).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

Forms of ``address`` (``parse_pool_address``):

- one address, ``ipc://PATH`` or ``tcp://HOST:PORT``: a pool of one;
- several, as a list or comma-separated: ``ipc:///run/a.sock,ipc:///run/b.sock``;
- ``dns://NAME:PORT``: every address NAME resolves to, each as ``tcp://IP:PORT`` (re-resolved every
  ``resolve_interval_s`` by the pool; the resolver is injectable, ``Resolver``).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Callable, Sequence

from code2wav.proto.address import address_problem

from .errors import InvalidArgument

__all__ = ["DNS_SCHEME", "PoolAddress", "Resolver", "parse_pool_address", "system_resolver", "tcp_address"]

DNS_SCHEME = "dns://"

Resolver = Callable[[str], Sequence[str]]
"""``resolver(name)`` -> the IP addresses ``name`` has now (an empty list when it has none). Raising ``OSError``
means "could not resolve now": the pool keeps the sidecars it has."""


@dataclass(frozen=True)
class PoolAddress:
    """What ``parse_pool_address`` made of an address: fixed ``addresses``, or a DNS ``name`` and ``port``."""

    addresses: tuple[str, ...] = ()
    name: str | None = None
    port: int = 0

    @property
    def pooled(self) -> bool:
        """More than one sidecar, or a DNS name (any number of them): a pool, not one sidecar."""
        return len(self.addresses) != 1

    def resolve(self, resolver: Resolver) -> list[str]:
        """The sidecar addresses now (fixed ones as given; a DNS name's records as ``tcp://`` addresses)."""
        if self.name is None:
            return list(self.addresses)
        return sorted({tcp_address(ip, self.port) for ip in resolver(self.name)})

    def __str__(self) -> str:
        return f"{DNS_SCHEME}{self.name}:{self.port}" if self.name is not None else ",".join(self.addresses)


def tcp_address(ip: str, port: int) -> str:
    """``tcp://IP:PORT`` (an IPv6 address in brackets)."""
    return f"tcp://[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"tcp://{ip}:{port}"


def system_resolver(name: str) -> list[str]:
    """The host's resolver (``getaddrinfo``): every IPv4 and IPv6 address of ``name``."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def parse_pool_address(address: str | Sequence[str]) -> PoolAddress:
    """Check and split a pool's ``address`` (module docstring); ``InvalidArgument`` naming the forms if wrong."""
    items = [part.strip() for part in address.split(",")] if isinstance(address, str) else [str(a) for a in address]
    items = [item for item in items if item]
    if not items:
        raise InvalidArgument("a pool needs at least one address (ipc://PATH, tcp://HOST:PORT or dns://NAME:PORT)")
    if any(item.startswith(DNS_SCHEME) for item in items):
        if len(items) != 1:
            raise InvalidArgument(f"a {DNS_SCHEME}NAME:PORT address stands alone (one name per pool), got {items}")
        name, sep, port = items[0][len(DNS_SCHEME):].rpartition(":")
        if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"{items[0]!r} is not {DNS_SCHEME}NAME:PORT (e.g. "
                                  f"{DNS_SCHEME}code2wav-sidecar.tts.svc.cluster.local:5555)")
        return PoolAddress(name=name, port=int(port))
    for item in items:
        problem = address_problem(item)
        if problem is not None:
            raise InvalidArgument(f"{problem} (a pool also takes a comma-separated list, or {DNS_SCHEME}NAME:PORT)")
    if len(set(items)) != len(items):
        raise InvalidArgument(f"a pool names each sidecar once, got {items}")
    return PoolAddress(addresses=tuple(items))
