"""The KV offloading tier's files (``--kv-offloading-disk``): one file per host block spilled,
written and read back on a thread of their own, so the step never waits on the disk.

Layout: ``PATH/<identity digest>/<block hash>.kvb``. The identity (``model_identity``) names
everything the bytes of a block depend on: the checkpoint (its path, revision, and each weight
file's name, size and modification time; the seed of dummy weights), the dtype and KV dtype,
the block size, the tensor-parallel rank and size, the host block's shape, and how the values
are computed (``compute``: the quantization flag, the matmul numerics, the platform's
kernels), since one checkpoint quantized at load gives other keys and values. A restarted
engine of the same model finds its files and starts warm; another model looks in another
folder, and a file moved between folders still carries its identity's digest in its header.

A file is a header (magic, identity digest, block hash, payload length, blake2b checksum of
the payload) and the payload, the host block's bytes. A read checks all of them and treats a
missing, truncated, too long, corrupt or foreign file as a miss: it logs why, deletes the file, and
reports the read as failed; the block's bytes are never used. Files are written to a temporary
name and renamed, so a crash never leaves half a file under a block's name; a write that fails
(a full disk) deletes its temporary file, and the next engine deletes those a crash left. A
folder deleted under the running engine is made again by the next write; while it cannot be
(or the disk refuses writes), writes are misses, with one log line per stretch of them.

The limit (``--kv-offloading-disk-size``) is for the folder given: an engine starting on it
deletes the block files of other identities (earlier models, layouts or options), and their
folders once empty, which otherwise stayed for good. Folders and files not the tier's are left
alone. So two engines of different models must not share a folder.

A read not done within ``READ_TIMEOUT_S`` (a network mount that stopped answering, or a
backlog of writes ahead of it) is a miss too: its requests recompute instead of waiting for
good. It is abandoned, not cancelled: the disk thread may still finish it, so the bytes reach
the host block only under a lock that the abandoning takes, never after; and until the thread
gets through anything again, new reads are misses at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic

import torch

from pagedserve.logger import get_logger

logger = get_logger(__name__)

_MAGIC = b"PSKVBLK1"
_HEADER = struct.Struct("<8s32s16sQ32s")  # magic, identity, block hash, length, checksum
HEADER_BYTES = _HEADER.size
_SUFFIX = ".kvb"
# Block bytes queued for the disk thread, at most: a disk slower than the host tier's
# evictions would otherwise grow the queue in host memory without end. A spill past it is
# dropped, and its block is a miss when read.
MAX_QUEUED_WRITE_BYTES = 1 << 30
# Seconds a queued read may take before it is a miss (above: why a read may stop answering).
READ_TIMEOUT_S = 10.0


@dataclass
class _Read:
    block_hash: bytes
    queued_at: float
    future: Future = field(default_factory=Future)
    copied: bool = False  # its bytes are in the host block (set under the tier's lock)
    abandoned: bool = False  # reported a miss; its bytes must never reach the block


def model_identity(model_path: Path, revision: str | None, seed: int | None, dtype: str,
                   kv_dtype: str, block_size: int, tp_rank: int, tp_size: int,
                   block_shape: tuple[int, ...], compute: dict) -> dict:
    """What a block's bytes depend on (``seed``: of dummy weights, else None; ``compute``:
    the options and platform that change the computed values, by name)."""
    files = sorted(p for p in model_path.iterdir() if p.suffix in
                   (".safetensors", ".bin", ".gguf", ".json")) if model_path.is_dir() \
        else [model_path]
    weights = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return dict(model=str(model_path.resolve()), revision=revision, weights=weights, seed=seed,
                dtype=dtype, kv_dtype=kv_dtype, block_size=block_size, tp_rank=tp_rank,
                tp_size=tp_size, block_shape=list(block_shape), compute=compute)


class DiskTier:
    def __init__(self, root: Path, identity: dict) -> None:
        text = json.dumps(identity, sort_keys=True)
        self.identity = hashlib.sha256(text.encode()).digest()
        self._identity_text = text
        self.folder = Path(root) / _folder_name(self.identity)
        self._make_folder()
        _reclaim_other_identities(Path(root), self.folder.name)
        for stale in self.folder.glob("*.tmp"):  # writes an engine stopped in the middle of
            with contextlib.suppress(OSError):
                stale.unlink()
        # One thread: a block's write, read and delete run in the order they were queued.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv-disk")
        self._reads: list[_Read] = []
        self._queued_write_bytes = 0  # added here, taken off by the disk thread
        self._lock = threading.Lock()  # the write queue's bytes; a read's copy or abandonment
        self._dropping = False
        self._stalled = False  # a read was abandoned and the thread has finished nothing since
        self._writes_failing = False  # the last write failed (one log line per stretch)

    def _make_folder(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        identity_file = self.folder / "identity.json"
        if not identity_file.exists():  # a restart on a full disk starts with what is there
            identity_file.write_text(self._identity_text)

    def stored_hashes(self) -> list[bytes]:
        """Hashes of the block files present, least recently written first."""
        found = []
        for path in self.folder.glob("*" + _SUFFIX):
            try:
                st = path.stat()
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime_ns, bytes.fromhex(path.stem)))
            except (OSError, ValueError):
                continue
        return [h for _, h in sorted(found) if len(h) == 16]

    def _path(self, block_hash: bytes) -> Path:
        return self.folder / (block_hash.hex() + _SUFFIX)

    def write(self, block_hash: bytes, block: torch.Tensor) -> None:
        """Queue a file of ``block``'s bytes, taken now (the host block may be reused)."""
        num_bytes = block.numel() * block.element_size()
        with self._lock:
            if self._queued_write_bytes + num_bytes > MAX_QUEUED_WRITE_BYTES:
                if not self._dropping:  # one line per stretch of drops
                    logger.warning("KV disk tier: the disk is behind by %d MiB of writes; "
                                   "blocks are dropped until it catches up",
                                   self._queued_write_bytes >> 20)
                self._dropping = True
                return
            self._queued_write_bytes += num_bytes
            self._dropping = False
        payload = block.contiguous().view(torch.uint8).numpy().tobytes()
        self._io.submit(self._write_queued, block_hash, payload)

    def _write_queued(self, block_hash: bytes, payload: bytes) -> None:
        try:
            self._write_file(block_hash, payload)
        finally:
            with self._lock:
                self._queued_write_bytes -= len(payload)
            self._stalled = False

    def _write_file(self, block_hash: bytes, payload: bytes) -> None:
        header = _HEADER.pack(_MAGIC, self.identity, block_hash, len(payload),
                              hashlib.blake2b(payload, digest_size=32).digest())
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            if not self.folder.is_dir():  # deleted under the engine
                self._make_folder()
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            # A full disk fails mid-file: what was written would hold the space for good.
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not self._writes_failing:
                logger.warning("KV disk tier: cannot write %s: %s; blocks are not written "
                               "(misses later) until the disk takes them again", path, exc)
            self._writes_failing = True
            return
        if self._writes_failing:
            logger.info("KV disk tier: writes to %s go through again", self.folder)
        self._writes_failing = False

    def read(self, block_hash: bytes, block: torch.Tensor) -> None:
        """Queue a read of ``block_hash``'s file into the host block ``block``; its outcome
        comes back from ``finished_reads``."""
        read = _Read(block_hash, monotonic())
        if self._stalled:  # it would wait behind the read the disk has not answered
            read.future.set_result(False)
        else:
            self._io.submit(self._read_queued, read, block)
        self._reads.append(read)

    def _read_queued(self, read: _Read, block: torch.Tensor) -> None:
        try:
            read.future.set_result(self._read_file(read, block))
        except BaseException as exc:
            read.future.set_exception(exc)
        finally:
            self._stalled = False

    def _read_file(self, read: _Read, block: torch.Tensor) -> bool:
        block_hash = read.block_hash
        path = self._path(block_hash)
        num_bytes = block.numel() * block.element_size()
        try:
            # Opening a named pipe would wait for a writer, and every queued read and write
            # with it.
            if not stat.S_ISREG(path.stat().st_mode):
                logger.warning("KV disk tier: miss, %s is not a regular file", path)
                return False
            # One byte past a block's file tells a longer one; a file of any size under a
            # block's name is never taken into memory whole.
            with open(path, "rb") as f:
                data = f.read(HEADER_BYTES + num_bytes + 1)
        except OSError as exc:
            logger.warning("KV disk tier: miss, cannot read %s: %s", path, exc)
            return False
        why = self._check(data, block_hash, num_bytes)
        if why is not None:
            logger.warning("KV disk tier: miss, %s is %s; deleting it", path, why)
            with contextlib.suppress(OSError):
                path.unlink()
            return False
        payload = torch.frombuffer(bytearray(data[HEADER_BYTES:]), dtype=torch.uint8)
        with self._lock:
            if read.abandoned:  # reported a miss: the host block may hold another's bytes
                return False
            block.view(torch.uint8).view(-1).copy_(payload)
            read.copied = True
        return True

    def _check(self, data: bytes, block_hash: bytes, num_bytes: int) -> str | None:
        """Why ``data`` is not ``block_hash``'s block of this model, or None."""
        if len(data) < HEADER_BYTES:
            return "truncated"
        magic, identity, stored_hash, length, checksum = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            return "not a KV block file"
        if identity != self.identity:
            return "written for another model or layout"
        if stored_hash != block_hash or length != num_bytes:
            return "another block"
        payload = memoryview(data)[HEADER_BYTES:]
        if len(payload) != length:
            return "truncated" if len(payload) < length else "too long"
        if hashlib.blake2b(payload, digest_size=32).digest() != checksum:
            return "corrupt (checksum mismatch)"
        return None

    def delete(self, block_hash: bytes) -> None:
        self._io.submit(self._path(block_hash).unlink, missing_ok=True)

    def finished_reads(self, wait_s: float = 0.0) -> list[tuple[bytes, bool]]:
        """(hash, whether it checked out) of each read done since the last call, and a miss
        for each queued longer than ``READ_TIMEOUT_S``, after waiting up to ``wait_s`` for
        the first one while some are under way."""
        if wait_s and self._reads:
            wait([r.future for r in self._reads], timeout=wait_s, return_when="FIRST_COMPLETED")
        finished, pending = [], []
        late = monotonic() - READ_TIMEOUT_S
        for read in self._reads:
            if read.future.done():
                finished.append((read.block_hash, read.future.result()))
            elif read.queued_at < late and self._abandon(read):
                finished.append((read.block_hash, False))
            else:
                pending.append(read)
        self._reads = pending
        return finished

    def _abandon(self, read: _Read) -> bool:
        """Make ``read`` a miss unless its bytes are already in the block (its result is
        then moments away: it stays pending)."""
        with self._lock:
            if read.copied:
                return False
            read.abandoned = True
        if not self._stalled:  # one line per stall
            logger.warning("KV disk tier: a read has waited %.0f s for the disk; reads are "
                           "misses until it answers", READ_TIMEOUT_S)
        self._stalled = True
        return True

    def flush(self) -> None:
        """Wait for every queued write, read and delete."""
        self._io.submit(lambda: None).result()


def _folder_name(identity: bytes) -> str:
    return identity.hex()[:32]


def _reclaim_other_identities(root: Path, own: str) -> None:
    """Delete the tier's files in the identity folders under ``root`` but ``own``, and each
    folder left empty (one log line)."""
    num_files = num_bytes = 0
    for folder in root.iterdir():
        if folder.name == own or not _is_identity_folder(folder):
            continue
        for path in folder.iterdir():
            if path.suffix in (_SUFFIX, ".tmp") or path.name == "identity.json":
                with contextlib.suppress(OSError):
                    size = path.lstat().st_size
                    path.unlink()
                    num_files, num_bytes = num_files + 1, num_bytes + size
        with contextlib.suppress(OSError):
            folder.rmdir()  # left if it holds anything else
    if num_files:
        logger.info("KV disk tier: deleted %d files (%d MiB) of other models or layouts in %s",
                    num_files, num_bytes >> 20, root)


def _is_identity_folder(path: Path) -> bool:
    return (len(path.name) == 32 and all(c in "0123456789abcdef" for c in path.name)
            and path.is_dir() and not path.is_symlink())
