"""The engine on an NVIDIA GPU: HF equivalence, CUDA graphs against eager, FP8 KV cache, CPU
weight offload."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.devices import HAS_NVIDIA, NVIDIA_REASON
from tests.tiny_models import REFERENCE_ATTENTION, VOCAB, write_tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON),
]
NEW = 32


@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def _prompts(seed=0, lens=(5, 33, 70, 129)):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lens]


def _greedy(llm, prompts, **extra):
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, **extra)
    return llm.generate(prompts, params, use_tqdm=False)


def _hf_greedy(folder, prompt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=REFERENCE_ATTENTION).cuda().eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW,
                             do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_greedy_matches_transformers_on_gpu(tiny, eager):
    llm = LLM(model=str(tiny), device="cuda", dtype="float32", block_size=16,
              kv_cache_memory_bytes=64 << 20, enforce_eager=eager, max_num_seqs=8)
    prompts = _prompts()
    for prompt, out in zip(prompts, _greedy(llm, prompts)):
        assert out.outputs[0].token_ids == _hf_greedy(tiny, prompt)


def test_graph_replay_equals_eager_bf16_logprobs(tiny):
    prompts = _prompts(seed=1, lens=(3, 17, 40, 64, 90, 11, 7))
    runs = {}
    for eager in (True, False):
        llm = LLM(model=str(tiny), device="cuda", dtype="bfloat16",
                  kv_cache_memory_bytes=64 << 20, enforce_eager=eager, max_num_seqs=16)
        runs[eager] = _greedy(llm, prompts, logprobs=0)
    for a, b in zip(runs[True], runs[False]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        # Graphs use a fixed split of the context, so bf16 sums may round differently; the
        # tokens must agree until a near-tie, and logprobs stay within bf16 noise.
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        assert same >= NEW // 2
        la = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs[:same]]
        lb = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs[:same]]
        assert max(abs(x - y) for x, y in zip(la, lb)) < 0.05


def test_fp8_kv_cache_logprobs_within_tolerance(tiny):
    """Teacher-forced logprobs of one sequence with a bf16 and an fp8 cache. Small chunks make
    every chunk read its context back from the (quantized) cache."""
    seq = _prompts(seed=2, lens=(160,))[0]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    got = {}
    blocks = {}
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(model=str(tiny), device="cuda", dtype="bfloat16", kv_cache_dtype=kv_dtype,
                  kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=32, enforce_eager=True)
        out = llm.generate([seq], params, use_tqdm=False)[0]
        got[kv_dtype] = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], seq[1:])]
        blocks[kv_dtype] = llm.engine.kv.num_blocks
    diffs = [abs(a - b) for a, b in zip(got["auto"], got["fp8"])]
    print(f"fp8 KV: max |dlogprob| {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.4f}")
    assert sum(diffs) / len(diffs) < 0.05
    assert max(diffs) < 0.5
    # Same byte budget, half the bytes per element: twice the blocks.
    assert blocks["fp8"] == 2 * blocks["auto"]


def test_copy_and_swap_blocks_move_every_layer():
    from pagedserve.platforms.cuda.platform import CudaPlatform

    cache = torch.randn(3, 2, 10, 4, 2, 8, device="cuda")
    src = torch.tensor([1, 4], device="cuda")
    dst = torch.tensor([7, 2], device="cuda")
    before = cache[:, :, src].clone()
    CudaPlatform.copy_blocks(cache, src, dst)
    torch.testing.assert_close(cache[:, :, dst], before)
    # The host pool is block-major: one contiguous unit per block of all layers.
    host = torch.zeros(5, 3, 2, 4, 2, 8).pin_memory()
    copier = CudaPlatform.block_copier()
    copier.to_host(cache, host, [1, 4], [0, 1])
    copier.wait_host()
    torch.testing.assert_close(host[[0, 1]], before.movedim(2, 0).cpu())
    copier.to_device(host, cache, [1], [9])
    copier.wait_device()
    torch.testing.assert_close(cache[:, :, 9], before[:, :, 1])


def test_host_tier_restores_prefixes_that_left_the_device(tiny):
    """The KV host tier on the GPU (its copy kernel reading and writing pinned host memory on
    the copy stream): multi-turn conversations whose histories left a 16-block device pool
    give the tokens of the same turns without the tier, and logprobs within float32's
    rounding (a restored prefix's keys were computed in another step's shape than the
    recomputed ones), and the later turns hit the host."""
    from tests.tiny_models import make_llm

    def turns(llm) -> list:
        rng = random.Random(4)
        history = [[rng.randrange(3, VOCAB) for _ in range(90)] for _ in range(4)]
        outs = []
        for _ in range(3):
            for c in range(4):
                [out] = _greedy(llm, [history[c]], logprobs=1)
                outs.append(out.outputs[0])
                history[c] += out.outputs[0].token_ids + [rng.randrange(3, VOCAB)
                                                          for _ in range(10)]
        return outs

    engine = dict(device="cuda", dtype="float32", enforce_eager=True, num_blocks=16)
    without = turns(make_llm(tiny, **engine))
    tiered = make_llm(tiny, **engine, kv_offloading_size=1 / 16)
    for a, b in zip(turns(tiered), without):
        assert a.token_ids == b.token_ids
        got = [d[t].logprob for d, t in zip(a.logprobs, a.token_ids)]
        want = [d[t].logprob for d, t in zip(b.logprobs, b.token_ids)]
        assert got == pytest.approx(want, abs=1e-4)
    stats = tiered.engine.stats()
    assert stats.offload_host_hits > 0 and stats.offload_bytes_to_device > 0


@pytest.mark.parametrize("layers", [3, 5], ids=["3-of-5", "all"])
def test_cpu_offload_equals_the_resident_model(tmp_path, layers):
    """--cpu-offload-gb: layers in pinned host memory, copied on the side stream into two
    staging slots, give the eager resident model's bf16 tokens and logprobs exactly (the
    copies are bit-exact and the kernels the same); no graphs are captured."""
    folder = write_tiny_model(tmp_path / "llama5", "llama3", num_hidden_layers=5)
    engine = dict(model=str(folder), device="cuda", dtype="bfloat16",
                  kv_cache_memory_bytes=64 << 20, max_num_seqs=16)
    resident = LLM(**engine, enforce_eager=True)
    layer = resident.engine.executor.runner.model.model.layers[0]
    per_layer = sum(p.numel() * p.element_size() for p in layer.parameters())
    llm = LLM(**engine, cpu_offload_gb=(layers - 0.5) * per_layer / 2**30)
    runner = llm.engine.executor.runner
    assert runner.offload.chosen == range(5 - layers, 5) and runner.graphs is None
    assert all(h.host.is_pinned() for h in runner.offload._host.values())
    assert all(s.is_cuda for s in runner.offload.slots)
    prompts = _prompts(seed=2, lens=(3, 17, 40, 64, 90, 11, 7))
    for a, b in zip(_greedy(resident, prompts, logprobs=2), _greedy(llm, prompts, logprobs=2)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [sorted((t, x.logprob) for t, x in d.items()) for d in a.outputs[0].logprobs] == \
            [sorted((t, x.logprob) for t, x in d.items()) for d in b.outputs[0].logprobs]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_speculative_verify_steps_equal_plain_greedy_on_gpu(tiny, eager):
    """Drafts from the plain engine's own continuation, every third one wrong, verified in
    float32 eagerly or through the verify-step graphs: the tokens equal the plain engine's,
    and with graphs the verify steps replay."""
    from tests.engine.test_speculative import OracleProposer
    from tests.engine.test_speculative_lossless import FreeDrafts

    prompts = _prompts()
    options = dict(device="cuda", dtype="float32", block_size=16, enforce_eager=eager,
                   gpu_memory_utilization=0.3)
    plain = [o.outputs[0].token_ids for o in _greedy(LLM(model=str(tiny), **options), prompts)]
    llm = LLM(model=str(tiny), speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 4}, **options)
    llm.engine.speculation.proposer = OracleProposer(
        {tuple(p): t for p, t in zip(prompts, plain, strict=True)})
    llm.engine.speculation.step_times = FreeDrafts()
    runner = llm.engine.executor.runner
    replays = []
    if not eager:
        real_run = runner.graphs.run
        runner.graphs.run = lambda ids, pos, ctx: replays.append(ctx.attn.max_query_len) or \
            real_run(ids, pos, ctx)
    assert [o.outputs[0].token_ids for o in _greedy(llm, prompts)] == plain
    assert llm.engine.speculation.counters.num_accepted_tokens > 0
    assert eager or max(replays) > 1


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_draft_model_steps_equal_plain_greedy_on_gpu(tiny, eager, tmp_path):
    """A noisy copy of the target as its draft model, in float32, eager or with the draft's
    decode passes and the target's verify steps replayed as graphs: the tokens equal the plain
    engine's and drafts are accepted."""
    from tests.engine.test_speculative_draft_model import _noisy_copy
    from tests.engine.test_speculative_lossless import FreeDrafts

    prompts = _prompts()
    options = dict(device="cuda", dtype="float32", block_size=16, enforce_eager=eager,
                   gpu_memory_utilization=0.3)
    plain = [o.outputs[0].token_ids for o in _greedy(LLM(model=str(tiny), **options), prompts)]
    draft = _noisy_copy(tiny, tmp_path / "draft", 0.004)
    llm = LLM(model=str(tiny), speculative_config={"model": str(draft),
                                                   "num_speculative_tokens": 4}, **options)
    llm.engine.speculation.step_times = FreeDrafts()
    drafter = llm.engine.executor.runner.drafter
    assert eager or drafter.runner.graphs is not None
    assert [o.outputs[0].token_ids for o in _greedy(llm, prompts)] == plain
    assert llm.engine.speculation.counters.mean_acceptance_length > 1.5
