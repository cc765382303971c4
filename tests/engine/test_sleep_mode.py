"""Sleep mode, weight updates and the prefix-cache reset, as RL frameworks use them between
training steps (vLLM's ``LLM.sleep`` / ``wake_up`` / ``reset_prefix_cache``), on the CPU."""

from __future__ import annotations

import gc
import weakref

import pytest
from safetensors.torch import load_file

from pagedserve import SamplingParams
from pagedserve.config import ConfigError
from pagedserve.errors import EngineSleepingError
from tests.graph_stubs import record_graphs
from tests.tiny_models import (
    assert_greedy_matches,
    hf_model,
    make_llm,
    random_prompts,
    write_tiny_model,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts("sleep", [40, 7, 23])


def _tokens(llm, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _checkpoint(folder) -> list:
    return list(load_file(folder / "model.safetensors").items())


@pytest.fixture
def llm(llama3_folder):
    return make_llm(llama3_folder, enable_sleep_mode=True)


def test_level_1_gives_the_same_tokens_after_wake_up(llm):
    before = _tokens(llm)
    llm.sleep(level=1)
    assert llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping()
    assert _tokens(llm) == before


def test_sleep_frees_the_kv_pool_and_the_weights_storage(llm):
    runner = llm.engine.executor.runner
    pool = weakref.ref(runner.kv_cache.pool)
    weight = next(runner.model.parameters())
    shape = weight.shape
    llm.sleep(level=1)
    gc.collect()
    assert runner.kv_cache is None and pool() is None
    assert weight.numel() == 0  # the same Parameter object, its storage swapped out
    llm.wake_up(tags=["weights"])
    assert weight.shape == shape and llm.is_sleeping()  # the KV cache still sleeps
    llm.wake_up(tags=["kv_cache"])
    assert runner.kv_cache is not None and not llm.is_sleeping()


def test_requests_are_refused_while_asleep_and_served_after(llm):
    before = _tokens(llm)
    llm.sleep(level=1)
    with pytest.raises(EngineSleepingError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    with pytest.raises(EngineSleepingError):  # the weights are still away
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["weights"])
    assert not llm.engine.has_unfinished_requests()
    assert _tokens(llm) == before


def test_sleep_is_refused_while_requests_run(llm):
    llm.engine.add_request(PROMPTS[0], GREEDY)
    llm.engine.step()
    with pytest.raises(RuntimeError, match="requests are running"):
        llm.sleep()
    assert not llm.is_sleeping()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.sleep()
    assert llm.is_sleeping()


def test_level_2_then_load_weights_of_the_same_checkpoint(llm, llama3_folder):
    before = _tokens(llm)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    with pytest.raises(EngineSleepingError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.load_weights(_checkpoint(llama3_folder))
    llm.wake_up(tags=["kv_cache"])
    assert _tokens(llm) == before


@pytest.mark.parametrize("arch", ["llama3", "qwen3-moe"])
def test_load_weights_reads_a_quantized_checkpoint_as_the_start_did(tiny_model_folder,
                                                                     tmp_path, arch):
    """The tensors go through the checkpoint's format (GPTQ's packed parts here), as at
    start-up: level 2 and the packed checkpoint give the tokens of before (Qwen3-MoE: its
    experts' quantized stacks refilled in place)."""
    from tests.quant.packers import write_quantized_pair

    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
            "desc_act": False}
    write_quantized_pair(tiny_model_folder(arch), tmp_path / "q", tmp_path / "f", gptq)
    llm = make_llm(tmp_path / "q", enable_sleep_mode=True)
    before = _tokens(llm)
    llm.sleep(level=2)
    llm.wake_up()
    llm.load_weights(_checkpoint(tmp_path / "q"))
    assert _tokens(llm) == before


def test_load_weights_of_another_checkpoint_matches_transformers_on_it(llm, tmp_path):
    other = write_tiny_model(tmp_path / "other", "llama3", seed=7)
    before = _tokens(llm)
    llm.load_weights(_checkpoint(other))
    assert _tokens(llm) != before
    assert assert_greedy_matches(llm, hf_model(other), PROMPTS, 12) >= len(PROMPTS) - 1


def test_load_weights_resets_the_prefix_cache(llm, tmp_path):
    """A prompt computed under the old weights must not be reused under the new ones."""
    _tokens(llm, PROMPTS[:1])
    llm.load_weights(_checkpoint(write_tiny_model(tmp_path / "other", "llama3", seed=7)))
    hits = llm.engine.stats().prefix_hit_tokens
    _tokens(llm, PROMPTS[:1])
    assert llm.engine.stats().prefix_hit_tokens == hits


def test_wake_up_resets_the_prefix_cache_of_the_new_pool(llm):
    """The pool comes back empty: a block hash kept from before would hand out garbage."""
    before = _tokens(llm, PROMPTS[:1])
    llm.sleep(level=1)
    llm.wake_up()
    hits = llm.engine.stats().prefix_hit_tokens
    assert _tokens(llm, PROMPTS[:1]) == before
    assert llm.engine.stats().prefix_hit_tokens == hits


def test_reset_prefix_cache_drops_hits_and_is_refused_while_requests_run(llama3_folder):
    llm = make_llm(llama3_folder)
    _tokens(llm, PROMPTS[:1])
    hits = llm.engine.stats().prefix_hit_tokens
    _tokens(llm, PROMPTS[:1])
    assert llm.engine.stats().prefix_hit_tokens > hits  # a hit before the reset
    llm.engine.add_request(PROMPTS[1], GREEDY)
    assert llm.reset_prefix_cache() is False
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache() is True
    hits = llm.engine.stats().prefix_hit_tokens
    _tokens(llm, PROMPTS[:1])
    assert llm.engine.stats().prefix_hit_tokens == hits  # none after


def test_graphs_are_captured_again_on_wake_up(llama3_folder, monkeypatch):
    """Graphs read the tensors' addresses at capture: those made before sleep are dropped,
    and new ones captured over the new KV pool once the engine is fully awake."""
    captured = record_graphs(monkeypatch)
    llm = make_llm(llama3_folder, enable_sleep_mode=True)
    runner = llm.engine.executor.runner
    assert captured and runner.graphs is captured[0]
    llm.sleep(level=1)
    assert runner.graphs is None
    llm.wake_up(tags=["kv_cache"])
    assert runner.graphs is None and len(captured) == 1  # the weights are still away
    llm.wake_up(tags=["weights"])
    assert len(captured) == 2 and runner.graphs is captured[1]
    assert captured[1].kv_caches[0].data_ptr() == runner.kv_cache.layers[0].data_ptr()


def test_load_weights_captures_the_graphs_again(llama3_folder, monkeypatch):
    """Loading builds new weight tensors and frees the old ones, whose addresses graphs
    captured before would replay (on an H100 the decode steps after a load then gave other
    tokens): an awake engine's graphs are captured again after the load; an engine whose
    KV pool still sleeps captures them once it wakes up."""
    captured = record_graphs(monkeypatch)
    llm = make_llm(llama3_folder, enable_sleep_mode=True)
    runner = llm.engine.executor.runner
    layer = runner.model.model.layers[0].mlp.down_proj
    old_method = layer.method
    llm.load_weights(_checkpoint(llama3_folder))
    assert layer.method is not old_method  # built anew: the reason for the capture
    assert len(captured) == 2 and runner.graphs is captured[1]
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.load_weights(_checkpoint(llama3_folder))
    assert len(captured) == 2 and runner.graphs is None
    llm.wake_up(tags=["kv_cache"])
    assert len(captured) == 3 and runner.graphs is captured[2]


def test_sleep_mode_must_be_on_and_levels_and_tags_are_checked(llama3_folder, llm):
    off = make_llm(llama3_folder)
    with pytest.raises(ConfigError, match="--enable-sleep-mode"):
        off.sleep()
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    assert not llm.is_sleeping()
    llm.sleep()
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["kv"])
    with pytest.raises(ConfigError, match="--cpu-offload-gb"):
        make_llm(llama3_folder, enable_sleep_mode=True, cpu_offload_gb=0.001)
