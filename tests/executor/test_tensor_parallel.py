"""Tensor parallelism on the CPU: two ranks over gloo give the tokens one rank gives. The
tests marked slow start a second rank (a process, or a Ray cluster of two nodes)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.config import ConfigError
from tests.devices import HAS_NVIDIA
from tests.quant.fp8_ct_checkpoints import write_block_fp8
from tests.quant.packers import write_quantized_pair
from tests.sample.ban_token import BanToken, MarkedBanToken
from tests.tiny_models import make_llm, random_prompts, write_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts("tp", [5, 17, 40, 3])
DIST_TIMEOUT_S = "60"  # Ray's engines: a failure ends in a minute, not the default five

# (architecture, config overrides): KV heads per rank 1 (llama3: 2 of 8 heads; qwen2: 2 of 4,
# with q/k/v biases and a tied head; qwen3: 2 of 4, with q/k norms every rank holds whole),
# and fewer KV heads than ranks (mistral: 1, replicated); the odd vocabularies pad the last
# rank's slice of the embedding and the LM head. Mixture of experts: each rank holds half of
# every expert's intermediate rows and the whole router (mixtral; qwen3-moe-dense1 with a
# dense layer beside the sparse one; qwen2-moe's shared expert, cut as the dense MLP is and
# summed with the experts by one all-reduce, its gate whole on each rank). Phi-3's fused
# checkpoint tensors: each rank its slice of q, of k and of v (1 of 2 KV heads, partial
# rotary), of gate and of up; Granite's scalars. Gemma 2: windows, caps (the logit cap on each
# rank's slice of the vocabulary) and norms every rank holds whole, an odd vocabulary.
CASES = {
    "llama3": ("llama3", {}),
    "qwen2-bias-tied-odd-vocab": ("qwen2", {"vocab_size": 385}),
    "qwen3-qk-norm": ("qwen3", {}),
    "mistral-one-kv-head-odd-vocab": ("mistral", {"vocab_size": 387}),
    "mixtral-experts": ("mixtral", {}),
    "qwen3-moe-dense-layer": ("qwen3-moe-dense1", {}),
    "qwen2-moe-shared-expert": ("qwen2-moe", {}),
    "phi3-fused-partial-rotary": ("phi3", {}),
    "phi3-longrope": ("phi3-longrope", {}),
    "granite-multipliers": ("granite", {}),
    "gemma2-windows-caps-odd-vocab": ("gemma2", {"vocab_size": 387}),
}


@contextlib.contextmanager
def two_ranks(folder, **options) -> Iterator:
    """An ``LLM`` of two tensor-parallel ranks, whose other rank is stopped afterwards."""
    llm = make_llm(folder, tensor_parallel_size=2, **options)
    try:
        yield llm
    finally:
        llm.engine.shutdown()


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [c.token_ids for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


# Two CPU ranks over gloo, or two GPUs over NCCL in float32 with CUDA graphs for the decode
# steps (the gpu_check.sh part tp2-tests).
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not HAS_NVIDIA or torch.cuda.device_count() < 2,
                                         reason="needs two NVIDIA GPUs")])]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_give_one_ranks_greedy_tokens(tmp_path, case, device):
    arch, overrides = CASES[case]
    folder = write_tiny_model(tmp_path / arch, arch, **overrides)
    options = {} if device == "cpu" else dict(device=device, dtype="float32",
                                              kv_cache_memory_bytes=64 << 20)
    one = make_llm(folder, **options)
    expected = _tokens(one, PROMPTS, GREEDY)
    del one
    # Async scheduling: most steps take their input tokens from the previous step's output,
    # which rank 0 broadcast to the other rank's device.
    with two_ranks(folder, async_scheduling=True, **options) as llm:
        assert _tokens(llm, PROMPTS, GREEDY) == expected


@pytest.mark.slow
def test_features_with_two_ranks(tmp_path):
    """Chunked prefill (a small token budget), prefix caching (a shared prefix), swap
    preemption (a pool too small for the parallel samples of n=3), async scheduling and
    prompt logprobs: every rank moves its own heads' blocks, and rank 0 alone samples."""
    folder = write_tiny_model(tmp_path / "llama3", "llama3")
    prefix = random_prompts("prefix", [35])[0]
    prompts = [prefix + p for p in random_prompts("tails", [4, 9, 2])]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=1)
    parallel = SamplingParams(n=3, max_tokens=24, temperature=0.9, seed=5, ignore_eos=True)
    options = dict(num_blocks=18, block_size=8, max_num_batched_tokens=24,
                   preemption_mode="swap", async_scheduling=True)

    def run(llm):
        outs = llm.generate(prompts + prompts[:1], [greedy] * 3 + [parallel], use_tqdm=False)
        return ([[c.token_ids for c in o.outputs] for o in outs],
                [o.prompt_logprobs for o in outs[:3]],
                llm.engine.scheduler.num_preemptions, llm.engine.kv.prefix_stats.hit_tokens)

    one = make_llm(folder, **options)
    tokens, logprobs, preemptions, hits = run(one)
    assert preemptions > 0 and hits > 0  # the features were exercised
    # --kv-cache-memory-bytes is per rank, and a rank's block holds half the KV heads.
    options["num_blocks"] = None
    with two_ranks(folder, kv_cache_memory_bytes=18 * one.engine.kv_bytes_per_block // 2,
                   **options) as llm:
        assert llm.engine.kv.pool.num_blocks == 18
        tp_tokens, tp_logprobs, tp_preemptions, tp_hits = run(llm)
    assert tp_tokens == tokens
    assert (tp_preemptions, tp_hits) == (preemptions, hits)
    for ours, ref in zip(tp_logprobs, logprobs):
        assert [list(p) if p else p for p in ours] == [list(p) if p else p for p in ref]
        for a, b in zip(ours[1:], ref[1:]):
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


@pytest.mark.slow
def test_sleep_wake_up_and_load_weights_with_two_ranks(tmp_path):
    """Every rank sleeps, wakes and loads the (whole) checkpoint, keeping its own slice: the
    tokens after level 1, and after level 2 with new weights, are one rank's on them."""
    from safetensors.torch import load_file

    folder = write_tiny_model(tmp_path / "m", "qwen2", vocab_size=385)
    other = write_tiny_model(tmp_path / "other", "qwen2", seed=3, vocab_size=385)
    expected = _tokens(make_llm(other), PROMPTS, GREEDY)
    with two_ranks(folder, enable_sleep_mode=True) as llm:
        before = _tokens(llm, PROMPTS, GREEDY)
        llm.sleep(level=1)
        llm.wake_up()
        assert _tokens(llm, PROMPTS, GREEDY) == before
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        llm.load_weights(load_file(other / "model.safetensors").items())
        llm.wake_up(["kv_cache"])
        assert _tokens(llm, PROMPTS, GREEDY) == expected != before


@pytest.mark.slow
def test_each_rank_makes_its_own_logits_processors(tmp_path):
    folder = write_tiny_model(tmp_path / "llama3", "llama3")
    one = _tokens(make_llm(folder), PROMPTS, GREEDY)
    bans = [dataclasses.replace(GREEDY, extra_args={"ban_token": out[0]}) for out in one]
    expected = _tokens(make_llm(folder, logits_processors=[BanToken]), PROMPTS, bans)
    with two_ranks(folder, logits_processors=[MarkedBanToken]) as llm:
        assert _tokens(llm, PROMPTS, bans) == expected
    assert len(list(tmp_path.glob("constructed-*"))) == 2  # the driver's rank, and the other


@pytest.mark.slow
def test_constrained_requests_with_two_ranks_running_ahead(tmp_path):
    """Grammar masks built between a step's forward pass and its sampling: rank 1 waits for
    the tokens meanwhile, and the tokens equal one rank's, one step at a time. The tiny
    vocabulary (384) is padded past its tokenizer's (300)."""
    from pagedserve import StructuredOutputsParams

    folder = write_tiny_model(tmp_path / "llama3", "llama3")
    params = [SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=s)
              for s in (StructuredOutputsParams(regex="(ab|c)+d"),
                        StructuredOutputsParams(choice=["yes", "no", "maybe"]),
                        StructuredOutputsParams(json={"type": "object", "properties": {
                            "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                            "required": ["n"]}))]
    params.append(GREEDY)
    expected = _tokens(make_llm(folder), PROMPTS, params)
    with two_ranks(folder, async_scheduling=True) as llm:
        assert _tokens(llm, PROMPTS, params) == expected


@pytest.mark.slow
def test_a_dead_rank_fails_the_step_at_once(tmp_path):
    folder = write_tiny_model(tmp_path / "mistral", "mistral")
    with two_ranks(folder) as llm:
        kill_rank_and_expect_failure(llm.engine, llm.engine.executor.remote.procs[0].kill)


def kill_rank_and_expect_failure(engine, kill, name: str = "rank 1") -> None:
    """A rank (rank 1 unless ``name`` says) dies mid-request: within a bounded time the step
    fails naming it, and the engine reports itself dead."""
    from pagedserve.executor.executor import WorkerDiedError

    engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    kill()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=re.escape(name)):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10.0
    assert name in engine.dead_reason()


# A driver script whose logits processor lives in its own ``__main__``: rank 1's process has
# another ``__main__`` (``pagedserve.executor.mp``), so it cannot unpickle the engine's options.
_MAIN_ONLY_PROCESSOR = """
import sys, time
from pagedserve import LLM
from tests.sample.ban_token import BanToken

class MainOnly(BanToken):
    pass

start = time.monotonic()
try:
    LLM(model=sys.argv[1], device="cpu", kv_cache_memory_bytes=4 << 20,
        tensor_parallel_size=2, logits_processors=[MainOnly])
except Exception as exc:
    print(f"after {time.monotonic() - start:.1f}s: {type(exc).__name__}: {exc}")
"""


@pytest.mark.slow
def test_a_rank_that_cannot_start_fails_the_start_at_once(tmp_path):
    """Rank 1 fails before it joins the process group: the driver, waiting for it there,
    reports its reason at once instead of after PAGEDSERVE_DIST_TIMEOUT_S."""
    folder = write_tiny_model(tmp_path / "llama3", "llama3")
    env = {**os.environ, "PAGEDSERVE_DIST_TIMEOUT_S": "600"}
    try:
        done = subprocess.run([sys.executable, "-c", _MAIN_ONLY_PROCESSOR, str(folder)],
                              env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the driver still waited for the dead rank after 120 s")
    assert done.returncode == 0, done.stderr
    assert re.search(r"WorkerDiedError: tensor-parallel rank 1 failed: cannot read the "
                     r"engine's options: AttributeError: .*MainOnly", done.stdout), done.stdout


@pytest.fixture(scope="module")
def two_node_cluster():
    """A Ray cluster of two nodes on this machine, shared by this file's Ray tests (each start
    takes seconds): the head node offers no CPU to actors, so a placement group must use the
    other. Its nodes' workers inherit DIST_TIMEOUT_S."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:  # while the nodes start
        patch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", DIST_TIMEOUT_S)
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 0, "include_dashboard": False})
        cluster.add_node(num_cpus=1)
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def ray_cluster(two_node_cluster, monkeypatch):
    """The shared cluster, for this test's engines (whose driver waits DIST_TIMEOUT_S too)."""
    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", DIST_TIMEOUT_S)
    monkeypatch.setenv("RAY_ADDRESS", two_node_cluster.address)
    return two_node_cluster


@pytest.mark.slow
@pytest.mark.parametrize("ranks,actor", [
    (dict(tensor_parallel_size=2), "rank 1"),
    # Two pipeline stages: the driver is stage 1, the actor stage 0.
    (dict(pipeline_parallel_size=2), "rank 0 (pipeline stage 0, tensor-parallel rank 0)"),
], ids=["tp2", "pp2"])
def test_ray_ranks_on_a_two_node_cluster(tmp_path, ray_cluster, ranks, actor):
    """The other rank is a Ray actor on the cluster's second node."""
    import ray

    folder = write_tiny_model(tmp_path / "qwen2", "qwen2", vocab_size=385)
    expected = _tokens(make_llm(folder), PROMPTS, GREEDY)
    try:
        llm = make_llm(folder, distributed_executor_backend="ray", **ranks)
        try:
            ((actor_node, devices),) = llm.engine.executor.remote.placements
            assert actor_node != ray_cluster.head_node.node_id and devices == []
            assert _tokens(llm, PROMPTS, GREEDY) == expected
            kill_rank_and_expect_failure(llm.engine, lambda: ray.kill(
                llm.engine.executor.remote.actors[0]), actor)
        finally:
            llm.engine.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_ray_rank_that_cannot_start_fails_the_start_at_once(tmp_path, monkeypatch,
                                                             ray_cluster):
    """The processor's module is on the driver's path only, so rank 1's actor cannot read its
    options (Ray pickles an importable class by reference): its failed ``build`` is reported
    while the driver waits for it to join."""
    import ray

    from pagedserve.executor.executor import WorkerDiedError

    folder = write_tiny_model(tmp_path / "llama3", "llama3")
    (tmp_path / "driver_only_processor.py").write_text(
        "from tests.sample.ban_token import BanToken\n\n\nclass DriverOnly(BanToken):\n"
        "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from driver_only_processor import DriverOnly

    try:
        start = time.monotonic()
        # Ray's text of the failed call spans lines: the actor's traceback follows.
        with pytest.raises(WorkerDiedError, match="(?s)tensor-parallel rank 1 failed: .*"
                                                  "No module named 'driver_only_processor'"):
            make_llm(folder, tensor_parallel_size=2, distributed_executor_backend="ray",
                     logits_processors=[DriverOnly])
        assert time.monotonic() - start < 30.0
    finally:
        ray.shutdown()
        del sys.modules["driver_only_processor"]


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}


@pytest.mark.slow
def test_gptq_checkpoint_splits_by_its_groups(tiny_model_folder, tmp_path):
    """4-bit groups of 32: o_proj's 64 input columns split into 32 per rank, on a group
    boundary, so each rank's kernel reads whole groups and the tokens stay one rank's."""
    write_quantized_pair(tiny_model_folder("llama3"), tmp_path / "q", tmp_path / "f", GPTQ)
    expected = _tokens(make_llm(tmp_path / "q"), PROMPTS, GREEDY)
    with two_ranks(tmp_path / "q") as llm:
        assert _tokens(llm, PROMPTS, GREEDY) == expected


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gptq", "block-fp8"])
def test_quantized_experts_split_by_their_groups_and_blocks(tmp_path, fmt):
    """Qwen3-MoE experts of 64 rows, 32 a rank: GPTQ groups of 32 and FP8 blocks of 32 x 32
    fall between the ranks, so each rank holds whole groups or blocks of its slice of every
    expert (kept quantized) and the tokens stay one rank's."""
    src = write_tiny_model(tmp_path / "m", "qwen3-moe", moe_intermediate_size=64)
    if fmt == "gptq":
        write_quantized_pair(src, tmp_path / "q", tmp_path / "f", GPTQ)
        folder = tmp_path / "q"
    else:
        folder = write_block_fp8(src, tmp_path, (32, 32)).quantized
    expected = _tokens(make_llm(folder), PROMPTS, GREEDY)
    with two_ranks(folder) as llm:
        assert _tokens(llm, PROMPTS, GREEDY) == expected


@pytest.mark.slow
@pytest.mark.parametrize("arch,change,message", [
    ("llama3", {"desc_act": True}, "act-order"),
    # qwen2's down_proj: 160 input columns, 80 per rank, not a multiple of the groups of 32
    ("qwen2", {}, "80 input columns .* groups of 32"),
])
def test_unsplittable_quantized_layers_are_refused(tiny_model_folder, tmp_path, arch, change,
                                                   message):
    write_quantized_pair(tiny_model_folder(arch), tmp_path / "q", tmp_path / "f",
                         {**GPTQ, **change})
    with pytest.raises(ConfigError, match=message):
        make_llm(tmp_path / "q", tensor_parallel_size=2)


def test_heads_that_do_not_split_are_refused_before_anything_starts(tiny_model_folder):
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3: the model's 8 attention "
                                          "heads do not divide into 3"):
        make_llm(tiny_model_folder("llama3"), tensor_parallel_size=3)


def test_one_rank_calls_no_collective(tiny_model_folder, monkeypatch):
    """The single-device engine is the model runner's step, with nothing distributed in it."""
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("a collective was called with one rank")

    for name in ("all_reduce", "gather", "broadcast", "init_process_group"):
        monkeypatch.setattr(dist, name, refuse)
    llm = make_llm(tiny_model_folder("qwen2"), async_scheduling=True)
    assert llm.engine.executor.remote is None
    assert not any(getattr(m, "reduce", False) for m in llm.engine.executor.runner.model.modules())
    assert all(len(o.outputs[0].token_ids) == 12
               for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_the_driver_takes_a_device_no_actor_on_its_node_has():
    from pagedserve.executor.ray_actors import first_free_device

    assert first_free_device([]) == 0
    assert first_free_device([["0"], ["2"]]) == 1
    assert first_free_device([["1"], ["0"]]) == 2

