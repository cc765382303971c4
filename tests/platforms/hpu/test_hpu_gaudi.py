"""The engine on a real Gaudi (skipped elsewhere): greedy tokens against transformers on the
CPU, through bucketing, warm-up, mark_step and HPU graphs, then with graphs off."""

from __future__ import annotations

import pytest

from tests.tiny_models import assert_greedy_matches, hf_model, random_prompts, write_tiny_model

pytestmark = pytest.mark.hpu


@pytest.fixture(scope="module")
def gaudi():
    pytest.importorskip("habana_frameworks.torch", reason="no Intel Gaudi software stack")
    from pagedserve.platforms import resolve_platform
    from pagedserve.platforms.interface import PlatformUnavailable

    try:
        return resolve_platform("hpu")
    except PlatformUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_matches_transformers_on_gaudi(gaudi, tmp_path, enforce_eager):
    from pagedserve import LLM

    folder = write_tiny_model(tmp_path / "llama3", "llama3")
    llm = LLM(model=str(folder), device="hpu", dtype="float32", max_num_seqs=8,
              kv_cache_memory_bytes=8 << 20, enforce_eager=enforce_eager)
    prompts = random_prompts("gaudi", [1, 5, 17, 130, 260, 9, 40, 3])
    assert assert_greedy_matches(llm, hf_model(folder), prompts, new_tokens=24) >= 6
