"""The device-armed hand-off's doorbell words in shared host memory (proto/README.md, section 3).

A sidecar creates one file per ``read`` region in ``/dev/shm`` (``DoorbellWords.create``): 32-bit words, zero at
first, mode 0600, a name nobody can guess (``PREFIX``, the sidecar's pid, 24 random hex digits). It sends the name
in ``region_registered``; the client maps the same file (``DoorbellWords.open``) and removes the name (``unlink``):
from then on only the two mappings reach the words. Both register their mapping for the GPU
(``Runtime.host_register``): the client's stream writes a token into a word after its codes, the sidecar's engine
stream waits for it.

Why host memory: the sidecar releases a wait the client never rings (it died, or its codes are late) by writing the
word from the CPU (``raise_behind``), which needs no GPU queue. A release queued on a GPU stream could sit behind the
very wait it should end: CUDA maps more streams than it has hardware queues onto the same queue (8 by default), or
funnels every process's work through a shared one under MPS, and a stream's wait holds up everything queued behind
it there.

No torch here, and nothing that needs a GPU: the words are plain shared memory (``tests/test_ipc_cpu.py`` maps one
file twice on the CPU). Writes from the CPU and the GPU race only in ways the protocol allows: a release that
overwrites a token rung at the same moment refuses a chunk whose codes were ready (it is resent), and a token that
lands after a release is a later value the wait already passed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from pathlib import Path

from code2wav.proto.ipc import DOORBELLS_PREFIX as PREFIX
from code2wav.proto.ipc import is_doorbells_name

__all__ = ["DoorbellWords", "PREFIX", "SHM_DIR", "WORD_NBYTES", "is_doorbells_name", "raised_word"]

SHM_DIR = Path("/dev/shm")
WORD_NBYTES = 4


def raised_word(word: int, token: int) -> int:
    """The value a release leaves in a word holding ``word`` for a wait on ``token``: the token + 1 if ``word`` is
    still behind it (cyclic: ``(word - token) mod 2^32 >= 2^31``), else ``word`` (rung in time, or ahead: never
    lowered). Pure: the arithmetic ``raise_behind`` applies."""
    behind = ((word - token) & 0xFFFFFFFF) >= 1 << 31
    return (token + 1) & 0xFFFFFFFF if behind else word


class DoorbellWords:
    """One region's doorbell words, mapped into this process. ``words[i]`` reads and writes word ``i`` (uint32);
    ``address`` is the mapping's host address (page aligned), for ``Runtime.host_register``."""

    def __init__(self, path: Path, fd: int, num_words: int, owner: bool) -> None:
        self.path = path
        self.name = path.name
        self.num_words = num_words
        self.nbytes = max(mmap.PAGESIZE, num_words * WORD_NBYTES)  # whole pages (host registration pins pages)
        self.owner = owner  # this process created the file (it removes the name at close if nobody did)
        try:
            self._map = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the memory
        self.words = (ctypes.c_uint32 * num_words).from_buffer(self._map)
        self.address = ctypes.addressof(self.words)

    @classmethod
    def create(cls, num_words: int, folder: Path = SHM_DIR) -> DoorbellWords:
        """A new file of ``num_words`` zero words (the sidecar), readable and writable by this user only."""
        if not 1 <= num_words <= mmap.PAGESIZE // WORD_NBYTES:
            raise ValueError(f"num_words must be 1 to {mmap.PAGESIZE // WORD_NBYTES}, got {num_words}")
        path = folder / f"{PREFIX}{os.getpid()}-{secrets.token_hex(12)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(mmap.PAGESIZE, num_words * WORD_NBYTES))  # zero-filled
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd, num_words, owner=True)

    @classmethod
    def open(cls, name: str, num_words: int, folder: Path = SHM_DIR) -> DoorbellWords:
        """Map the sidecar's file ``name`` (the client); raises ``ValueError`` for a name that is not a doorbell
        file's or a file too small for ``num_words``, ``OSError`` if it cannot be opened."""
        if not is_doorbells_name(name):  # what region_registered.doorbells carries (proto.ipc)
            raise ValueError(f"{name!r} is not a doorbell file's name ({PREFIX}<pid>-<24 hex digits>)")
        path = folder / name
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < num_words * WORD_NBYTES or size < mmap.PAGESIZE:
                raise ValueError(f"{path} holds {size} bytes, too few for {num_words} doorbell words")
        except Exception:
            os.close(fd)
            raise
        return cls(path, fd, num_words, owner=False)

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay): once the client mapped it, nobody else needs it."""
        self.path.unlink(missing_ok=True)

    def raise_behind(self, index: int, token: int) -> None:
        """A release: word ``index`` becomes ``raised_word`` of what it holds (the token + 1 if behind the token),
        written from the CPU."""
        word = self.words[index]
        raised = raised_word(word, token)
        if raised != word:
            self.words[index] = raised

    def close(self) -> None:
        """Unmap (the caller unregistered the mapping from the GPU first); the owner also removes the name if the
        client never did."""
        if self._map.closed:
            return
        del self.words  # the ctypes view holds an export of the mapping: released before it closes
        self._map.close()
        if self.owner:
            self.unlink()
