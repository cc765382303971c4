"""The offloading tier's block files: bytes come back exactly; a corrupt, truncated or
foreign file is a miss with a log line, and its bytes never reach the host block."""

import errno
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from pagedserve.worker import disk_tier
from pagedserve.worker.disk_tier import DiskTier, model_identity

SHAPE = (2, 2, 4, 2, 8)  # layers, keys/values, block size, heads, head dim
HASH, OTHER = bytes(range(16)), bytes(range(1, 17))
COMPUTE = dict(quantization="auto", int8_activations=True, fp8_fast_accumulation=True,
               platform="cpu")


def _identity(**changes) -> dict:
    return {"model": "/models/a", "dtype": "torch.float32", "block_size": 4, **changes}


def _written(root, dtype=torch.float32, identity=None) -> tuple[DiskTier, torch.Tensor]:
    disk = DiskTier(root, identity or _identity())
    block = torch.randn(SHAPE).to(dtype)
    disk.write(HASH, block)
    disk.flush()
    return disk, block


def _read(disk: DiskTier, block_hash: bytes = HASH, dtype=torch.float32):
    target = torch.zeros(SHAPE, dtype=dtype)
    disk.read(block_hash, target)
    disk.flush()
    [(got_hash, ok)] = disk.finished_reads()
    assert got_hash == block_hash
    return ok, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_comes_back_byte_for_byte_and_a_restart_finds_it(tmp_path, dtype):
    _, block = _written(tmp_path, dtype)
    restarted = DiskTier(tmp_path, _identity())
    assert restarted.stored_hashes() == [HASH]
    ok, target = _read(restarted, dtype=dtype)
    assert ok and torch.equal(target.view(torch.uint8), block.view(torch.uint8))


def test_another_model_looks_in_another_folder(tmp_path):
    _written(tmp_path)
    other = DiskTier(tmp_path, _identity(model="/models/b"))
    assert other.folder != DiskTier(tmp_path, _identity()).folder
    assert other.stored_hashes() == []


def _damage_payload(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def _truncate_into_the_header(path):
    path.write_bytes(path.read_bytes()[:20])


@pytest.mark.parametrize("damage, why", [(_damage_payload, "corrupt"), (_truncate, "truncated"),
                                         (_truncate_into_the_header, "truncated")])
def test_a_damaged_file_is_a_miss_with_a_log_line(tmp_path, caplog, damage, why):
    disk, _ = _written(tmp_path)
    path = disk.folder / (HASH.hex() + ".kvb")
    damage(path)
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.disk_tier"):
        ok, target = _read(disk)
    assert not ok and not target.any()  # not a byte of it was used
    assert why in caplog.text and not path.exists()


def test_a_file_of_another_model_moved_into_the_folder_is_a_miss(tmp_path, caplog):
    foreign, _ = _written(tmp_path / "elsewhere", identity=_identity(model="/models/b"))
    disk = DiskTier(tmp_path, _identity())
    name = HASH.hex() + ".kvb"
    (disk.folder / name).write_bytes((foreign.folder / name).read_bytes())
    assert disk.stored_hashes() == [HASH]
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.disk_tier"):
        ok, target = _read(disk)
    assert not ok and not target.any() and "another model" in caplog.text


def test_a_file_renamed_to_another_block_and_a_missing_file_are_misses(tmp_path, caplog):
    disk, _ = _written(tmp_path)
    (disk.folder / (HASH.hex() + ".kvb")).rename(disk.folder / (OTHER.hex() + ".kvb"))
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.disk_tier"):
        assert not _read(disk, OTHER)[0]
        assert not _read(disk, HASH)[0]
    assert "another block" in caplog.text and "cannot read" in caplog.text


def test_a_deleted_block_is_gone(tmp_path):
    disk, _ = _written(tmp_path)
    disk.delete(HASH)
    disk.flush()
    assert disk.stored_hashes() == []


def test_the_identity_names_the_weights_and_the_layout(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    args = dict(revision=None, seed=None, dtype="torch.float32", kv_dtype="torch.float32",
                block_size=16, tp_rank=0, tp_size=1, block_shape=SHAPE, compute=COMPUTE)
    base = model_identity(folder, **args)
    assert model_identity(folder, **{**args, "tp_rank": 1}) != base
    assert model_identity(folder, **{**args, "kv_dtype": "torch.float8_e4m3fn"}) != base
    for change in ({"quantization": "fp8"}, {"int8_activations": False},
                   {"fp8_fast_accumulation": False}, {"platform": "cuda"}):
        assert model_identity(folder, **{**args, "compute": {**COMPUTE, **change}}) != base
    (folder / "model.safetensors").write_bytes(b"y" * 11)  # new weights
    assert model_identity(folder, **args) != base


class _FullDisk:
    """A file that takes the header and then finds the disk full, as a write of the payload
    to a filled file system does."""

    def __init__(self, path, mode):
        self._file = open(path, mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def write(self, data):
        if self._file.tell() > 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._file.write(data)


def test_a_write_that_finds_the_disk_full_leaves_no_file(tmp_path, monkeypatch, caplog):
    """The half-written temporary file stayed, taking the space the next writes needed."""
    monkeypatch.setattr(disk_tier, "open", _FullDisk, raising=False)
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.disk_tier"):
        disk, _ = _written(tmp_path)
    assert "No space left" in caplog.text
    assert sorted(p.name for p in disk.folder.iterdir()) == ["identity.json"]
    assert not _read(disk)[0]


def test_temporary_files_a_stopped_engine_left_are_removed_at_start(tmp_path):
    disk, _ = _written(tmp_path)
    (disk.folder / (OTHER.hex() + ".tmp")).write_bytes(b"half a block")
    assert sorted(p.suffix for p in DiskTier(tmp_path, _identity()).folder.iterdir()) == \
        [".json", ".kvb"]


def test_a_restart_on_a_full_disk_starts_with_the_files_it_finds(tmp_path, monkeypatch):
    """The identity file was rewritten at every start: on a full disk the engine refused to
    start, though its folder and files were there."""
    _written(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    assert DiskTier(tmp_path, _identity()).stored_hashes() == [HASH]


def test_a_huge_file_under_a_block_name_is_a_miss_without_reading_it(tmp_path, caplog):
    """A TiB file (sparse) under a block's name: the read took all of it into memory first,
    and its MemoryError ended the engine's step."""
    disk, _ = _written(tmp_path)
    with open(disk.folder / (HASH.hex() + ".kvb"), "r+b") as f:
        f.truncate(2**40)
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.disk_tier"):
        ok, target = _read(disk)
    assert not ok and not target.any() and "too long" in caplog.text


def test_a_fifo_under_a_block_name_is_neither_found_nor_waited_on(tmp_path, caplog):
    """Opening a named pipe waits for a writer: the disk thread hung on it, and every read and
    write queued behind, so requests waiting on their prefix's files never started."""
    disk = DiskTier(tmp_path, _identity())
    os.mkfifo(disk.folder / (HASH.hex() + ".kvb"))
    assert DiskTier(tmp_path, _identity()).stored_hashes() == []
    target = torch.zeros(SHAPE)
    disk.read(HASH, target)
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.disk_tier"):
        [(_, ok)] = disk.finished_reads(wait_s=5.0)
    assert not ok and "not a regular file" in caplog.text


def test_writes_a_slow_disk_has_not_taken_are_dropped_past_a_bound(tmp_path, monkeypatch,
                                                                   caplog):
    """Every spill queued its block's bytes for the disk thread: a disk slower than the host
    tier's evictions grew the queue, in host memory, without end. Past the bound a spill is
    dropped (its block is then a miss), and writes resume once the queue drains."""
    block = torch.randn(SHAPE)
    monkeypatch.setattr(disk_tier, "MAX_QUEUED_WRITE_BYTES", 3 * block.numel() * 4)
    disk = DiskTier(tmp_path, _identity())
    slow = threading.Event()
    write_file = disk._write_file
    monkeypatch.setattr(disk, "_write_file", lambda *args: (slow.wait(), write_file(*args)))
    hashes = [bytes([i]) * 16 for i in range(8)]
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.disk_tier"):
        for block_hash in hashes:
            disk.write(block_hash, block)
    slow.set()
    disk.flush()
    assert disk.stored_hashes() == hashes[:3] and "dropped" in caplog.text
    disk.write(hashes[7], block)
    disk.flush()
    assert disk.stored_hashes()[-1] == hashes[7]


def test_a_read_the_disk_does_not_answer_is_a_miss_and_never_lands(tmp_path, monkeypatch,
                                                                    caplog):
    """A hung disk (a network mount) held its reads, and the requests waiting on them, for
    good. Past the timeout the read is a miss; the thread may still finish it, but its bytes
    must not reach the host block, which the KV manager has given to another block by then.
    Until the disk answers again, new reads are misses at once; then reads work again."""
    disk, block = _written(tmp_path)
    now = [0.0]  # the tier's clock, moved by the test alone
    monkeypatch.setattr(disk_tier, "monotonic", lambda: now[0])
    answer = threading.Event()
    monkeypatch.setattr(disk_tier, "open", lambda *args: (answer.wait(), open(*args))[1],
                        raising=False)
    target = torch.full(SHAPE, -7.0)  # the next owner's bytes
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.disk_tier"):
        disk.read(HASH, target)
        now[0] = disk_tier.READ_TIMEOUT_S - 0.1
        assert disk.finished_reads() == []  # under way
        now[0] = disk_tier.READ_TIMEOUT_S + 0.1
        assert disk.finished_reads() == [(HASH, False)]
    assert "waited" in caplog.text
    disk.read(OTHER, torch.zeros(SHAPE))
    assert disk.finished_reads() == [(OTHER, False)]  # not queued behind the hung one
    answer.set()
    disk.flush()
    assert torch.equal(target, torch.full(SHAPE, -7.0))
    ok, again = _read(disk)
    assert ok and torch.equal(again, block)


def test_a_folder_deleted_under_the_engine_is_made_again(tmp_path):
    """Every write failed for good once the folder was gone."""
    disk, _ = _written(tmp_path)
    shutil.rmtree(disk.folder)
    disk.write(OTHER, torch.randn(SHAPE))
    disk.flush()
    assert _read(disk, OTHER)[0]
    assert not _read(disk, HASH)[0]  # went with the folder: a miss
    assert (disk.folder / "identity.json").exists()


def test_writes_a_folder_that_cannot_be_made_refuses_are_misses_with_one_warning(tmp_path,
                                                                                    caplog):
    disk, _ = _written(tmp_path)
    shutil.rmtree(disk.folder)
    disk.folder.write_bytes(b"not a folder")  # so the folder cannot be made
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.disk_tier"):
        for i in range(3):
            disk.write(bytes([i] * 16), torch.randn(SHAPE))
        disk.flush()
    assert len(caplog.records) == 1
    assert not _read(disk, bytes(16))[0]
    disk.folder.unlink()  # the disk takes writes again: so does the tier
    disk.write(OTHER, torch.randn(SHAPE))
    disk.flush()
    assert _read(disk, OTHER)[0]


def test_a_start_reclaims_the_folders_of_other_identities(tmp_path):
    """Each model's folder stayed for good, so the folder given held more than
    --kv-offloading-disk-size across restarts with other models. Folders not the tier's are
    left alone."""
    old, _ = _written(tmp_path, identity=_identity(model="/models/old"))
    (old.folder / "notes.txt").write_text("not the tier's")
    emptied, _ = _written(tmp_path, identity=_identity(model="/models/older"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.kvb").write_bytes(b"the user's")
    disk, _ = _written(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [disk.folder.name, old.folder.name, "mine"])
    assert [p.name for p in old.folder.iterdir()] == ["notes.txt"]
    assert (tmp_path / "mine" / "a.kvb").exists()
    assert not emptied.folder.exists()
    assert disk.stored_hashes() == [HASH]
