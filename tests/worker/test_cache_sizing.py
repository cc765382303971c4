"""The KV pool's size: a --kv-cache-memory-bytes the device cannot hold is refused naming the
flag (it was an allocation failure's traceback)."""

from __future__ import annotations

import pytest

from pagedserve.errors import ConfigError
from tests.tiny_models import make_llm


@pytest.mark.parametrize("num_bytes", [10**12 * 1024, 2**63 - 1])
def test_a_kv_cache_larger_than_the_device_is_refused(llama3_folder, num_bytes):
    with pytest.raises(ConfigError, match=rf"^--kv-cache-memory-bytes {num_bytes} exceeds the "
                                          r"device's [0-9.]+ GiB"):
        make_llm(llama3_folder, kv_cache_memory_bytes=num_bytes)


@pytest.mark.parametrize("options, flag", [
    (dict(kv_offloading_size=1e-9), "--kv-offloading-size"),
    (dict(kv_offloading_size=0.01, kv_offloading_disk_size=1e-9), "--kv-offloading-disk-size"),
])
def test_a_tier_too_small_for_one_block_is_refused(llama3_folder, tmp_path, options, flag):
    """It served with no tier at all (the disk tier's folder made, never written)."""
    if "kv_offloading_disk_size" in options:
        options["kv_offloading_disk"] = str(tmp_path)
    with pytest.raises(ConfigError, match=rf"^{flag} 1e-09 GiB holds no KV block "):
        make_llm(llama3_folder, **options)
