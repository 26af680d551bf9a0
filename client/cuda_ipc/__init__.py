"""CUDA IPC on the client side: device memory exported once per connection, offsets per chunk.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from .channel import IpcChannel, IpcUnavailable
from .slots import SlotAllocator

__all__ = ["IpcChannel", "IpcUnavailable", "SlotAllocator"]
