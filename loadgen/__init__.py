"""Client-side tools that drive a sidecar over the wire: ``demo`` and ``bench``.

Imports ``client`` (to talk to a sidecar) and, for in-process baselines only, ``sidecar``'s engine.
"""
