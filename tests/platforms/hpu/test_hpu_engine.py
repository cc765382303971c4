"""The whole engine through HpuPlatform's code path, on a fake habana_frameworks (CPU tensors).

What is checked: one ``mark_step`` per model forward (so one per engine step that computes,
and none for a step with nothing to compute); over a 200-step mixed workload (prompts of many
lengths, chunked prefill, decodes, preemption by a small KV pool) the forward sees at most
``ShapeBuckets.num_shapes`` distinct input shapes, every decode shape was run by the warm-up,
and greedy outputs equal those of the same workload with bucketing off. A real Gaudi is not
involved: these tests say nothing about its compiler or its numerics.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.platforms import resolve_platform
from pagedserve.worker.kv_cache import KVCacheSpec
from pagedserve.worker.warm_up import warm_up
from tests.platforms.hpu.fake_habana import install
from tests.tiny_models import (
    VOCAB,
    assert_greedy_matches,
    hf_model,
    random_prompts,
    write_tiny_model,
)

pytestmark = pytest.mark.hpu

NUM_STEPS = 200


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("hpu") / "llama3", "llama3")


def _engine(folder: Path, num_blocks: int | None = None, **options):
    """An engine on the (fake) HPU in float32, with ``num_blocks`` usable KV blocks."""
    options = dict(device="hpu", dtype="float32", max_num_seqs=6, max_num_batched_tokens=96,
                   max_model_len=512, **options)
    if num_blocks is not None:
        spec = KVCacheSpec(1, options.get("block_size", 128), torch.float32)
        bucketing = options.get("shape_bucketing") is not False  # one more: the pad block
        arch = _arch(folder)
        options["kv_cache_memory_bytes"] = (num_blocks + bucketing) * spec.bytes_per_block(
            arch, arch.num_kv_heads)
    return LLM(model=str(folder), **options).engine


class ForwardLog:
    """Records the input shapes of every model forward and the mark_step count around it."""

    def __init__(self, model: torch.nn.Module, fake) -> None:
        self.shapes: list[tuple] = []
        self.mark_steps_before: list[int] = []
        forward = model.forward

        def logged(input_ids, positions, kv_caches, ctx, incoming=None):
            meta = ctx.attn
            self.mark_steps_before.append(fake.core.mark_steps)
            self.shapes.append(tuple(tuple(t.shape) for t in (
                input_ids, positions, meta.query_start_loc, meta.seq_lens, meta.context_lens,
                meta.block_tables, meta.slot_mapping)) + (meta.max_seq_len,))
            return forward(input_ids, positions, kv_caches, ctx, incoming)

        model.forward = logged


def _run_workload(engine, seed: int = 0) -> dict[str, list[int]]:
    """At least 200 engine steps: a new request on 40% of the first 120 steps (prompts of 1-300
    tokens, 1-40 new tokens, greedy), then until every request finishes. Returns each
    request's tokens; every request has finished."""
    rng = random.Random(seed)
    outputs, steps = {}, 0
    while steps < NUM_STEPS or engine.has_unfinished_requests():
        if steps < 120 and rng.random() < 0.4:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 2, 7, 30, 120,
                                                                         rng.randrange(1, 300)]))]
            engine.add_request(prompt, SamplingParams(
                max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        steps += 1
        assert steps < 3 * NUM_STEPS
    return outputs


def test_hpu_platform_defaults(fake, model_folder):
    platform = resolve_platform("hpu")
    resolved = EngineConfig(device="hpu").resolve(_arch(model_folder), platform)
    assert (resolved.block_size, resolved.shape_bucketing, resolved.dtype) == (
        128, True, torch.bfloat16)
    cpu = EngineConfig(device="cpu").resolve(_arch(model_folder), resolve_platform("cpu"))
    assert (cpu.block_size, cpu.shape_bucketing) == (16, False)
    overridden = EngineConfig(device="hpu", block_size=32, shape_bucketing=False)
    assert overridden.resolve(_arch(model_folder), platform).block_size == 32


def _arch(folder: Path):
    from pagedserve.models import loader

    return loader.load_arch_config(loader.resolve_model(str(folder)))


def test_kv_pool_sized_from_the_profiled_peak(fake, model_folder, monkeypatch):
    """Budget = total * utilization - the peak the profiling forward reported, less the pad
    block: worked out here from the fake's counters."""
    monkeypatch.setattr(fake.hpu, "TOTAL_BYTES", 4 << 20)
    fake.hpu.peak_bytes = 1 << 20
    engine = LLM(model=str(model_folder), device="hpu", dtype="float32", max_num_seqs=32,
                 max_model_len=1024, gpu_memory_utilization=0.5).engine
    assert fake.hpu.peak_resets == 1
    per_block = engine.kv_bytes_per_block
    assert engine.kv.pool.num_blocks == ((2 << 20) - (1 << 20)) // per_block - 1
    assert engine.executor.runner.kv_cache.pool.shape[2] == engine.kv.pool.num_blocks + 1


def test_one_mark_step_per_forward_and_shapes_within_the_bucket_budget(fake, model_folder):
    engine = _engine(model_folder, num_blocks=6)
    buckets = engine.executor.runner.buckets
    # Warm-up: every decode shape, then a prompt step per token bucket but the first; each
    # forward closed by a mark_step.
    warm_up_forwards = fake.core.mark_steps
    assert warm_up_forwards == len(buckets.seqs) * len(buckets.widths) + len(buckets.tokens) - 1
    log = ForwardLog(engine.executor.runner.model, fake)
    warm_up(engine.executor.runner)  # again, to see its shapes (it writes only the pad block)
    warmed = set(log.shapes)
    warm_up_forwards *= 2
    log.shapes.clear()
    log.mark_steps_before.clear()
    _run_workload(engine)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prompt_tokens > 3000
    # mark_step n is called after forward n: before forward n, warm-up's + n have been.
    assert log.mark_steps_before == list(range(warm_up_forwards,
                                               warm_up_forwards + len(log.shapes)))
    assert fake.core.mark_steps == warm_up_forwards + len(log.shapes)
    assert len(log.shapes) >= NUM_STEPS - 20  # nearly every step computes
    distinct = set(log.shapes)
    print(f"fake HPU: {len(distinct)} distinct forward input shapes over {len(log.shapes)} "
          f"forwards, bucket budget {buckets.num_shapes}")
    assert len(distinct) <= buckets.num_shapes
    for shape in distinct:
        tokens, _, starts, _, _, table, _, max_seq_len = shape
        num_seqs = starts[0] - 1  # a decode step has as many tokens as sequences
        assert num_seqs in buckets.seqs and table[1] in buckets.widths
        assert tokens[0] == num_seqs or tokens[0] in buckets.tokens
        assert table == (num_seqs, table[1]) and max_seq_len == table[1] * 128
        if tokens[0] == num_seqs:  # decode shapes were all compiled at warm-up
            assert shape in warmed
    # Decode steps replay through the one wrapped module (its graphs recorded at warm-up).
    assert len(fake.hpu.wrapped) == 1 and engine.executor.runner.graphs.step is fake.hpu.wrapped[0]
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks  # nothing leaked


def test_mark_step_once_per_engine_step(fake, model_folder):
    engine = _engine(model_folder)
    before = fake.core.mark_steps
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0,
                                                 ignore_eos=True))
    counts = []
    while engine.has_unfinished_requests():
        engine.step()
        counts.append(fake.core.mark_steps - before - sum(counts))
    assert counts == [1, 1, 1, 1]  # one prefill and three decodes
    assert engine.step() == [] and fake.core.mark_steps - before == 4  # idle: no mark_step


def test_bucketing_keeps_greedy_outputs_and_bounds_shapes(fake, model_folder):
    """The same workload and KV pool with bucketing on and off: identical tokens, and
    bucketing sees fewer distinct shapes than the unpadded run."""
    runs = {}
    for bucketing in (True, False):
        engine = _engine(model_folder, num_blocks=6, shape_bucketing=bucketing,
                         preemption_mode="swap", enforce_eager=not bucketing)
        log = ForwardLog(engine.executor.runner.model, fake)
        runs[bucketing] = (_run_workload(engine, seed=1), set(log.shapes))
        assert engine.stats().num_preemptions > 0
    assert runs[True][0] == runs[False][0]
    print(f"distinct shapes: bucketed {len(runs[True][1])}, unpadded {len(runs[False][1])}")
    assert len(runs[True][1]) < len(runs[False][1])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_sliding_windows_match_transformers(fake, tiny_model_folder, arch):
    """Gemma's windows of 8 (and Gemma 2's caps) through the portable attention the HPU runs,
    over bucketed, padded steps of 128-token blocks with chunked prefill: greedy tokens equal
    transformers'."""
    folder = tiny_model_folder(arch)
    llm = LLM(model=str(folder), device="hpu", dtype="float32", max_num_seqs=6,
              max_num_batched_tokens=96, max_model_len=512)
    assert llm.engine.executor.runner.buckets is not None
    prompts = random_prompts(f"hpu-{arch}", [5, 30, 77, 140])
    assert assert_greedy_matches(llm, hf_model(folder), prompts, 16) == len(prompts)
