"""Pipeline parallelism on the CPU: stages of the decoder layers in processes over gloo give the
tokens and prompt logprobs one rank gives. The tests marked slow start the other ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.config import ConfigError, EngineConfig
from pagedserve.distributed import Layout, split_layers
from pagedserve.models import loader
from pagedserve.models.config import ModelArchConfig
from pagedserve.platforms import resolve_platform
from pagedserve.worker.kv_cache import KVCacheSpec
from pagedserve.worker.model_runner import ModelRunner
from tests.executor.test_tensor_parallel import kill_rank_and_expect_failure
from tests.tiny_models import ARCH_CONFIGS, make_llm, random_prompts, write_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
PROMPTS = random_prompts("pp", [5, 17, 40, 3])


@contextlib.contextmanager
def stages(folder, pp: int = 2, **options) -> Iterator:
    """An ``LLM`` of ``pp`` pipeline stages, whose other ranks are stopped afterwards."""
    llm = make_llm(folder, pipeline_parallel_size=pp, **options)
    try:
        yield llm
    finally:
        llm.engine.shutdown()


def _run(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([c.token_ids for o in outs for c in o.outputs],
            [o.prompt_logprobs for o in outs])


def _assert_same(ours, ref) -> None:
    """The same tokens, and prompt logprobs equal to float32 rounding."""
    assert ours[0] == ref[0]
    for got, want in zip(ours[1], ref[1]):
        if want is None:  # a request that asked for none
            assert got is None
            continue
        assert [list(p) if p else p for p in got] == [list(p) if p else p for p in want]
        for a, b in zip(got[1:], want[1:]):
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


@pytest.mark.parametrize("num_layers,pp,split", [
    (2, 2, (1, 1)), (3, 2, (2, 1)), (5, 3, (2, 2, 1)), (7, 4, (2, 2, 2, 1)),
    (10, 4, (2, 3, 3, 2)), (20, 4, (5, 5, 5, 5)), (4, 1, (4,))])
def test_the_even_split_gives_the_remainder_to_the_stages_before_the_last(num_layers, pp,
                                                                         split):
    assert split_layers(num_layers, pp) == split


@pytest.mark.parametrize("partition,message", [
    ((1, 1, 1), "each of the --pipeline-parallel-size 2 stages"), ((1, 1), "3 in all"),
    ((3, 0), "at least one layer")])
def test_a_partition_that_does_not_fit_is_refused(partition, message):
    assert split_layers(3, 2, (1, 2)) == (1, 2)
    with pytest.raises(ConfigError, match=message):
        split_layers(3, 2, partition)


@pytest.mark.parametrize("name", ["PAGEDSERVE_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION"])
def test_the_partition_comes_from_the_environment(monkeypatch, name):
    arch = ModelArchConfig.from_hf_dict({**ARCH_CONFIGS["llama3"], "vocab_size": 384})
    monkeypatch.delenv("PAGEDSERVE_PP_LAYER_PARTITION", raising=False)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    config = EngineConfig(device="cpu", pipeline_parallel_size=2)
    assert config.layer_split(arch) == (1, 1)
    monkeypatch.setenv(name, "2,0")
    with pytest.raises(ConfigError, match=r"2,0 \(PAGEDSERVE_PP_LAYER_PARTITION or "
                                          r"VLLM_PP_LAYER_PARTITION\) must give each"):
        config.layer_split(arch)
    monkeypatch.setenv(name, "1;1")
    with pytest.raises(ConfigError, match=f"^{name} must be layer counts"):
        config.layer_split(arch)


def _stage_runner(folder, layout: Layout, rank: int, split: tuple[int, ...]) -> ModelRunner:
    """Rank ``rank``'s runner, built and loaded in this process (no collective is called
    with one rank per stage), with a KV pool of 4 blocks."""
    from safetensors.torch import load_file

    arch = loader.load_arch_config(loader.resolve_model(str(folder), False))
    runner = ModelRunner(resolve_platform("cpu"), arch, torch.float32, 256,
                         stage=layout.stage(rank, split))
    runner.load_weights(load_file(folder / "model.safetensors").items())
    runner.allocate_kv_cache(KVCacheSpec(4, 16, torch.float32))
    return runner


def test_each_stage_holds_its_own_layers_and_their_kv(tmp_path):
    """Four layers over three stages (2, 1, 1): the first holds the embedding, the last the
    final norm and the tied LM head (the checkpoint's embedding table, which it reads itself),
    each its own layers' weights and KV pool alone."""
    folder = write_tiny_model(tmp_path / "m", "qwen2", num_hidden_layers=4)
    layout, split = Layout(1, 3), (2, 1, 1)
    runners = [_stage_runner(folder, layout, rank, split) for rank in range(3)]
    layers = [{int(n.split(".")[2]) for n, _ in r.model.named_parameters()
               if n.startswith("model.layers.")} for r in runners]
    assert layers == [{0, 1}, {2}, {3}]
    others = [{n for n, _ in r.model.named_parameters() if not n.startswith("model.layers.")}
              for r in runners]
    assert others == [{"model.embed_tokens.weight"}, set(),
                      {"model.norm.weight", "lm_head.weight"}]
    assert [r.kv_cache.pool.shape[0] for r in runners] == [2, 1, 1]
    assert [len(r.kv_cache.layers) for r in runners] == [2, 1, 1]
    assert torch.equal(runners[2].model.lm_head.weight,
                       runners[0].model.get_input_embeddings().weight)
    assert runners[1].kv_bytes_per_block(16) * 2 == runners[0].kv_bytes_per_block(16)


@pytest.mark.slow
@pytest.mark.parametrize("arch,overrides,options", [
    # Async scheduling: the first stage embeds the tokens the driver sampled last step.
    ("llama3", {}, dict(async_scheduling=True)),
    # Experts split with their layers.
    ("qwen3-moe", {}, {}),
    # Both: each stage's two tensor-parallel ranks all-reduce among themselves.
    ("llama3", {}, dict(tensor_parallel_size=2)),
    # Gemma's own decoder (norms, embedding scale, windowed layers on both stages), tied head.
    ("gemma3", {}, {}),
], ids=["llama3-async", "qwen3-moe", "llama3-tp2-pp2", "gemma3"])
def test_stages_give_one_ranks_tokens_and_prompt_logprobs(tmp_path, arch, overrides, options):
    folder = write_tiny_model(tmp_path / arch, arch, **overrides)
    expected = _run(make_llm(folder))
    with stages(folder, **options) as llm:
        _assert_same(_run(llm), expected)
        runner = llm.engine.executor.runner  # the driver's: the last stage
        assert runner.model.get_input_embeddings() is None
        assert runner.model.lm_head is not None and runner.model.model.norm is not None


@pytest.mark.slow
def test_the_tied_head_stage_sleeps_wakes_and_loads_weights(tmp_path):
    """Qwen2's tied head: the last stage reads the checkpoint's embedding table itself, at
    start and from ``load_weights`` (the whole checkpoint, each stage keeping its own). The
    tokens are one rank's before, after level 1, and on the new weights after level 2."""
    from safetensors.torch import load_file

    folder = write_tiny_model(tmp_path / "m", "qwen2", vocab_size=385)
    other = write_tiny_model(tmp_path / "other", "qwen2", seed=3, vocab_size=385)
    expected, after = _run(make_llm(folder)), _run(make_llm(other))
    with stages(folder, enable_sleep_mode=True) as llm:
        _assert_same(_run(llm), expected)
        llm.sleep(level=1)
        llm.wake_up()
        _assert_same(_run(llm), expected)
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        llm.load_weights(load_file(other / "model.safetensors").items())
        llm.wake_up(["kv_cache"])
        _assert_same(_run(llm), after)


@pytest.mark.slow
def test_lora_cpu_offload_and_beam_search(tiny_model_folder, tmp_path):
    """Adapters wrap each stage's own projections (the rank holds the whole adapter and loads
    its layers' part), offloaded layers stream within each stage, and beam search, a driver
    over the core, runs unchanged: the tokens are one rank's with the same options."""
    from pagedserve import LoRARequest
    from tests.lora.peft_adapters import ADAPTER_SPECS, write_adapter

    folder = write_tiny_model(tmp_path / "llama3", "llama3", num_hidden_layers=4)
    adapter = write_adapter(folder, tmp_path / "all", ADAPTER_SPECS["all"], seed=20)
    lora = LoRARequest("all", 1, str(adapter))
    beams = SamplingParams(n=2, best_of=3, use_beam_search=True, max_tokens=8, ignore_eos=True)
    options = dict(enable_lora=True, max_lora_rank=8, cpu_offload_gb=1.0)

    def run(llm):
        loras = [c.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                                   lora_request=lora) for c in o.outputs]
        return loras, _run(llm, PROMPTS[:2], beams)[0]

    one = make_llm(folder, **options)
    expected = run(one)
    assert expected[0] != _run(one)[0]  # the adapter changes the tokens
    with stages(folder, **options) as llm:
        assert run(llm) == expected
        runner = llm.engine.executor.runner
        assert runner.offload.chosen == range(2, 4)  # the driver's stage's layers
        assert {i for i, _ in runner.lora.layers} == {2, 3}


@pytest.mark.slow
def test_the_last_stage_pools(tmp_path):
    """``--runner pooling``: the driver pools the last stage's final hidden states."""
    folder = write_tiny_model(tmp_path / "m", "mistral", seed=3, base_model=True)
    prompts = random_prompts("pp-pool", [1, 23, 64])

    def embed(llm):
        return torch.tensor([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)])

    expected = embed(make_llm(folder))
    with stages(folder) as llm:
        assert torch.allclose(embed(llm), expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_an_uneven_partition_from_the_environment(tmp_path, monkeypatch):
    """Three layers of Mistral (one KV head) as 1,2 where the even split is 2,1: the driver's
    stage runs layers 1 and 2 and its KV pool holds them."""
    folder = write_tiny_model(tmp_path / "mistral", "mistral", num_hidden_layers=3)
    expected = _run(make_llm(folder))
    monkeypatch.setenv("PAGEDSERVE_PP_LAYER_PARTITION", "1,2")
    with stages(folder) as llm:
        _assert_same(_run(llm), expected)
        runner = llm.engine.executor.runner
        assert runner.model.model.layer_range == range(1, 3)
        assert runner.kv_cache.pool.shape[0] == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_prefix_caching_and_chunked_prefill(tmp_path, mode):
    """A pool too small for the parallel samples of n=3: each stage swaps (or drops) its own
    layers' blocks; a shared prefix hits the cache, and a small budget chunks the prompts."""
    folder = write_tiny_model(tmp_path / "llama3", "llama3")
    prefix = random_prompts("prefix", [35])[0]
    prompts = [prefix + p for p in random_prompts("tails", [4, 9, 2])]
    params = [GREEDY] * 3 + [SamplingParams(n=3, max_tokens=24, temperature=0.9, seed=5,
                                            ignore_eos=True)]
    options = dict(block_size=8, max_num_batched_tokens=24, preemption_mode=mode)

    def run(llm):
        return (_run(llm, prompts + prompts[:1], params), llm.engine.scheduler.num_preemptions,
                llm.engine.kv.prefix_stats.hit_tokens)

    one = make_llm(folder, num_blocks=18, **options)
    expected, preemptions, hits = run(one)
    assert preemptions > 0 and hits > 0  # the features were exercised
    # --kv-cache-memory-bytes is per rank, and a stage's block holds one of the two layers.
    with stages(folder, kv_cache_memory_bytes=18 * one.engine.kv_bytes_per_block // 2,
                **options) as llm:
        assert llm.engine.kv.pool.num_blocks == 18
        ours, pp_preemptions, pp_hits = run(llm)
    _assert_same(ours, expected)
    assert (pp_preemptions, pp_hits) == (preemptions, hits)


@pytest.mark.slow
def test_a_dead_stage_fails_the_step_at_once(tmp_path):
    folder = write_tiny_model(tmp_path / "llama3", "llama3")
    with stages(folder) as llm:
        kill_rank_and_expect_failure(llm.engine, llm.engine.executor.remote.procs[0].kill,
                                     "rank 0 (pipeline stage 0")


def test_too_few_layers_are_refused_before_any_rank_starts(tiny_model_folder):
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 3: the model has only 2 "
                                          "decoder layers"):
        make_llm(tiny_model_folder("llama3"), pipeline_parallel_size=3)


@pytest.mark.parametrize("options,message", [
    (dict(pipeline_parallel_size=0), "--pipeline-parallel-size must be at least 1"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram",
                                                        "num_speculative_tokens": 2}),
     "--speculative-config is not supported with --pipeline-parallel-size 2"),
    (dict(pipeline_parallel_size=2, kv_offloading_size=1.0, kv_offloading_disk="/tmp/x",
          kv_offloading_disk_size=1.0),
     "--kv-offloading-disk works with one rank only, not --tensor-parallel-size 1 x "
     "--pipeline-parallel-size 2"),
])
def test_refused_options(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(device="cpu", **options)


def test_more_ranks_than_devices_are_refused_before_any_starts(monkeypatch):
    from pagedserve.executor import executor
    from pagedserve.platforms.interface import Platform

    class FourGpus(Platform):
        name = "gpu"
        visible_devices_env = "GPU_VISIBLE"

        @classmethod
        def device_count(cls) -> int:
            return 4

    def refuse(*args):
        raise AssertionError("a backend started")

    monkeypatch.setattr(executor, "resolve_platform", lambda device: FourGpus)
    monkeypatch.setattr(executor, "_backend", refuse)
    monkeypatch.delenv("GPU_VISIBLE", raising=False)
    config = EngineConfig(device="cpu", tensor_parallel_size=4, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 4 x --pipeline-parallel-size "
                                          r"2 needs 8 gpu devices on this host"):
        executor.Executor(config, (1, 1))


def test_ray_gives_the_drivers_stage_to_the_actors_on_its_node():
    """TP=8 x PP=2 on two nodes of 8 devices, the driver's node offering 7 to actors (it
    takes the eighth): ranks 9-15 go to its actors, ranks 0-7 to the other node's, however
    Ray ordered the bundles."""
    from pagedserve.executor.ray_actors import assign_ranks

    nodes = ["b", "a"] * 7 + ["b"]
    ranks = assign_ranks(Layout(8, 2), nodes, driver_node="a")
    assert sorted(r for r, n in zip(ranks, nodes) if n == "a") == list(range(9, 16))
    assert sorted(r for r, n in zip(ranks, nodes) if n == "b") == list(range(8))
    assert assign_ranks(Layout(2, 1), ["a"], driver_node="a") == [1]
