"""The model runner's start-up measurements."""

from __future__ import annotations

from pagedserve import LLM
from tests.tiny_models import write_tiny_model


def test_memory_profile_splits_a_budget_longer_than_the_context(tmp_path):
    """A token budget above max_model_len is profiled as several prompts: one prompt that long
    would index positions past the rotary table."""
    folder = write_tiny_model(tmp_path / "llama3", "llama3")
    runner = LLM(model=str(folder), device="cpu", kv_cache_memory_bytes=1 << 20,
                 max_model_len=64).engine.runner
    assert runner.profile_peak_memory(num_tokens=3 * 64 + 5, max_num_seqs=4,
                                      block_size=16) >= 0
    assert runner.kv_cache is None
