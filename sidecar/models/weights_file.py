"""A weights file's sanity before it is read: not a Git LFS pointer, not empty, and for ``.safetensors`` a whole
file (its header's tensors all end inside it). Each problem is one ``CheckpointError`` line that says the fix."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from .family import CheckpointError

LFS_POINTER_PREFIX = b"version https://git-lfs"
SAFETENSORS_HEADER_MAX_BYTES = 100 << 20


def check_weights_file(path: Path) -> None:
    """Refuse, with the fix, a weights file that cannot hold the weights (see the module docstring)."""
    size_bytes = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(len(LFS_POINTER_PREFIX))
    if head.startswith(LFS_POINTER_PREFIX):
        raise CheckpointError(f"{path} is a Git LFS pointer ({size_bytes} bytes), not the weights: fetch them with "
                              "`git lfs install && git lfs pull` in that checkout (or download the file itself)")
    if size_bytes == 0:
        raise CheckpointError(f"{path} is empty: download it again")
    if path.suffix == ".safetensors":
        _check_safetensors(path, size_bytes)


def _check_safetensors(path: Path, size_bytes: int) -> None:
    """The 8-byte header length, the JSON header, and the end of the last tensor's data against the file size."""
    redownload = "download it again (compare its size with the source's)"
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: truncated ({size_bytes} bytes, not even a safetensors header); {redownload}")
        (header_bytes,) = struct.unpack("<Q", prefix)
        opening = f.read(1)
        f.seek(8)
        if header_bytes > SAFETENSORS_HEADER_MAX_BYTES or (opening and opening != b"{"):
            raise CheckpointError(f"{path} is not a safetensors file (no JSON header after its first 8 bytes); give "
                                  "the checkpoint's own model.safetensors")
        if 8 + header_bytes > size_bytes:
            raise CheckpointError(f"{path}: truncated inside its header ({size_bytes} bytes of at least "
                                  f"{8 + header_bytes}); {redownload}")
        try:
            header = json.loads(f.read(header_bytes))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object)")
    ends = [entry["data_offsets"][1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets", ())) == 2]
    needed_bytes = 8 + header_bytes + max(ends, default=0)
    if needed_bytes > size_bytes:
        raise CheckpointError(f"{path}: truncated ({size_bytes} bytes of {needed_bytes}: the download stopped "
                              f"early); {redownload}")
