"""The architectures that came after the first CUDA runs, on an NVIDIA GPU: mixture of experts
(the Triton ``fused_moe`` kernel, decode steps in CUDA graphs), Phi-3 (fused projections cut
per shard, partial rotary), Granite (its multipliers) and Gemma 2 and 3 (sliding windows,
caps) against transformers, eager and with CUDA graphs; and sleep mode on the GPU (device
memory given back, page-locked copies, graphs captured again)."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from safetensors.torch import load_file

from pagedserve import SamplingParams
from tests.devices import HAS_NVIDIA, NVIDIA_REASON
from tests.tiny_models import (
    assert_greedy_matches,
    hf_model,
    make_llm,
    random_prompts,
    write_tiny_model,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON),
]
PROMPTS = random_prompts("cuda-archs", [5, 33, 70, 129])
NEW = 24
KV_BYTES = 256 << 20


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe-dense1", "phi3", "granite"])
def arch_folder(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_greedy_matches_transformers_on_gpu(arch_folder, eager):
    """float32 on the GPU against transformers' float32 on the CPU (a near-tie may break
    either way); without ``enforce_eager`` every model, mixture of experts included, replays
    graphs."""
    _assert_greedy_on_gpu(arch_folder, eager)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_sliding_windows_match_transformers_on_gpu(tiny_model_folder, arch, eager):
    """Gemma's windows of 8 (tests/tiny_models.py) under prompts of up to 129 tokens, eager
    and in replayed decode graphs (the window and the cap are kernel arguments fixed per
    layer)."""
    _assert_greedy_on_gpu(tiny_model_folder(arch), eager)


def _assert_greedy_on_gpu(folder, eager: bool) -> None:
    llm = make_llm(folder, device="cuda", dtype="float32", enforce_eager=eager,
                   kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
    assert (llm.engine.executor.runner.graphs is None) == eager
    assert assert_greedy_matches(llm, hf_model(folder), PROMPTS, NEW) >= len(PROMPTS) - 1


def test_bfloat16_logprobs_near_float32(arch_folder):
    """bfloat16 on the GPU (the Triton kernels, graphs where the model takes them): the same
    prompts teacher-forced, the prompt tokens' logprobs within bfloat16's noise of float32's.
    Mixture-of-experts models may route a token to another expert where two router logits
    are within bfloat16's rounding (Mixtral on an H100: one position off by 0.52, the mean
    0.019), so for them only the mean is bounded."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    got = {}
    for dtype in ("float32", "bfloat16"):
        llm = make_llm(arch_folder, device="cuda", dtype=dtype, kv_cache_memory_bytes=64 << 20)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        got[dtype] = [d[t].logprob for o, prompt in zip(outs, PROMPTS)
                      for d, t in zip(o.prompt_logprobs[1:], prompt[1:])]
    diffs = [abs(a - b) for a, b in zip(got["float32"], got["bfloat16"])]
    print(f"bf16 against fp32: max |dlogprob| {max(diffs):.4f}, "
          f"mean {sum(diffs) / len(diffs):.4f}")
    assert len(diffs) == sum(len(p) - 1 for p in PROMPTS)
    assert sum(diffs) / len(diffs) < 0.05
    config = json.loads((arch_folder / "config.json").read_text())
    if not ({"num_experts", "num_local_experts"} & config.keys()):
        assert max(diffs) < 0.3


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe"])
def moe_folder(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_graphs_give_the_eager_tokens(moe_folder, dtype):
    """The Triton experts read their routing on the device, so a mixture-of-experts model's
    decode steps replay CUDA graphs: the same greedy tokens as eager steps, and in float32
    transformers' tokens (a near-tie excepted, as above)."""
    tokens = {}
    for eager in (True, False):
        llm = make_llm(moe_folder, device="cuda", dtype=dtype, enforce_eager=eager,
                       kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
        assert (llm.engine.executor.runner.graphs is None) == eager
        tokens[eager] = _tokens(llm)
    assert tokens[False] == tokens[True]
    if dtype == "float32":
        assert assert_greedy_matches(llm, hf_model(moe_folder), PROMPTS, NEW) >= len(PROMPTS) - 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["block-fp8", "fp8-static", "fp8-at-load"])
def test_fp8_moe_graphs_give_the_eager_and_dequantized_tokens(moe_folder, tmp_path, monkeypatch,
                                                              fmt, dtype):
    """FP8 experts read as they are by the Triton kernel (block FP8 in blocks of 32, partial
    at Mixtral's 48 expert rows; per tensor; ``--quantization fp8``'s per row): decode steps
    replay CUDA graphs and give the eager steps' greedy tokens, and agree with the per-step
    dequantize path (the platform's ops without ``fused_moe_fp8``; ``_assert_paths_agree``)."""
    from pagedserve.models.fp8_experts import Fp8Experts
    from pagedserve.platforms.cuda.layer_ops import TritonLayerOps
    from tests.quant.fp8_ct_checkpoints import write_block_fp8, write_fp8

    folder, options = moe_folder, {"quantization": "fp8"}
    if fmt != "fp8-at-load":
        options = {}
        folder = (write_block_fp8(moe_folder, tmp_path, (32, 32)) if fmt == "block-fp8"
                  else write_fp8(moe_folder, tmp_path, static=True)).quantized
    tokens, logprobs = {}, {}
    for path in ("eager", "graphs", "dequantize"):
        if path == "dequantize":
            monkeypatch.setattr(TritonLayerOps, "fused_moe_fp8", None)
        tokens[path], logprobs[path] = _run_experts_path(folder, dtype, path, Fp8Experts,
                                                         **options)
    assert tokens["graphs"] == tokens["eager"]
    _assert_paths_agree(tokens, logprobs, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq-8bit", "gptq-act-order"])
def test_int_moe_graphs_give_the_eager_and_dequantized_tokens(moe_folder, tmp_path, monkeypatch,
                                                              fmt, dtype):
    """Integer experts read as they are by the Triton kernel (AWQ in groups of 32, partial at
    Mixtral's 48 expert rows; GPTQ symmetric in groups of 32; GPTQ 8-bit asymmetric, one group
    a row): decode steps replay CUDA graphs and give the eager steps' greedy tokens, and agree
    with the per-step dequantize path (the platform's ops without ``fused_moe_int``;
    ``_assert_paths_agree``). GPTQ act-order stays on the dequantize path, without graphs."""
    from pagedserve.models.int_experts import IntExperts
    from pagedserve.platforms.cuda.layer_ops import TritonLayerOps
    from tests.models.test_quantized_moe import AWQ, GPTQ, GPTQ_8BIT, GPTQ_ACT_ORDER
    from tests.quant.packers import write_quantized_pair

    config = {"awq": AWQ, "gptq": GPTQ, "gptq-8bit": GPTQ_8BIT,
              "gptq-act-order": GPTQ_ACT_ORDER}[fmt]
    folder = tmp_path / fmt
    write_quantized_pair(moe_folder, folder, tmp_path / "reference", config)
    fused = fmt != "gptq-act-order"
    tokens, logprobs = {}, {}
    for path in ("eager", "graphs", "dequantize") if fused else ("dequantize",):
        if path == "dequantize" and fused:
            monkeypatch.setattr(TritonLayerOps, "fused_moe_int", None)
        tokens[path], logprobs[path] = _run_experts_path(folder, dtype, path, IntExperts)
    if fused:
        assert tokens["graphs"] == tokens["eager"]
        _assert_paths_agree(tokens, logprobs, dtype)


@pytest.fixture(scope="module")
def llama3_cuda_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama3"), "llama3")


def _tokens(llm) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _run_experts_path(folder, dtype: str, path: str, kernel_form: type,
                      **options) -> tuple[list[list[int]], list[float]]:
    """One path of a quantized mixture of experts (``eager`` or ``graphs`` through the fused
    kernel, whose experts are ``kernel_form``; ``dequantize`` per step): its greedy tokens and
    prompt logprobs, after checking that the experts and the graphs are the path's."""
    from pagedserve.models.moe import FusedExperts

    llm = make_llm(folder, device="cuda", dtype=dtype, enforce_eager=path == "eager",
                   kv_cache_memory_bytes=64 << 20, max_num_seqs=8, **options)
    runner = llm.engine.executor.runner
    experts = [m.quantized for m in runner.model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(isinstance(q, kernel_form) == (path != "dequantize")
                           for q in experts)
    assert (runner.graphs is not None) == (path == "graphs")
    return _tokens(llm), _prompt_logprobs(llm)


def _prompt_logprobs(llm) -> list[float]:
    """The prompts teacher-forced: each prompt token's logprob after the tokens before it."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [d[t].logprob for o, prompt in zip(outs, PROMPTS)
            for d, t in zip(o.prompt_logprobs[1:], prompt[1:])]


def _assert_paths_agree(tokens: dict, logprobs: dict, dtype: str) -> None:
    """The fused kernel's eager path against the per-step dequantize path. In float32 and
    float16 their greedy tokens (a near-tie may break either way). In bfloat16 the two round
    differently (the dequantized weight to 8 bits of mantissa, the kernel's products not), and
    a tiny random model's greedy path turns on near-ties: on an H100 one, two or none of the
    four continuations stayed equal. There the teacher-forced prompt logprobs are compared,
    their mean gap within bfloat16's noise (as test_bfloat16_logprobs_near_float32 bounds it
    for mixtures of experts, whose routing may flip on a near-tie)."""
    if dtype != "bfloat16":
        same = sum(a == b for a, b in zip(tokens["eager"], tokens["dequantize"]))
        assert same >= len(PROMPTS) - 1
        return
    gaps = [abs(a - b) for a, b in zip(logprobs["eager"], logprobs["dequantize"], strict=True)]
    assert sum(gaps) / len(gaps) < 0.05, (max(gaps), sum(gaps) / len(gaps))


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_sleep_gives_device_memory_back_and_the_same_tokens(llama3_cuda_folder, eager):
    """Level 1: the KV pool and the weights leave the GPU (the allocator's count falls by at
    least the pool), come back from page-locked host copies, and the graphs captured again
    read the new tensors: the same greedy tokens as before."""
    llm = make_llm(llama3_cuda_folder, device="cuda", dtype="bfloat16", enforce_eager=eager,
                   kv_cache_memory_bytes=KV_BYTES, enable_sleep_mode=True, max_num_seqs=8)
    before = _tokens(llm)
    awake = _allocated()
    llm.sleep(level=1)
    asleep = _allocated()
    assert awake - asleep >= KV_BYTES * 0.9
    llm.wake_up()
    assert _allocated() >= awake - (1 << 20)
    assert _tokens(llm) == before


def test_sleep_level_2_and_load_weights_on_gpu(llama3_cuda_folder, tmp_path):
    """Level 2 drops the weights; loading the same checkpoint gives the tokens of before, and
    another checkpoint's tokens equal transformers' on it (graphs captured again each time)."""
    llm = make_llm(llama3_cuda_folder, device="cuda", dtype="float32",
                   kv_cache_memory_bytes=64 << 20, enable_sleep_mode=True, max_num_seqs=8)
    before = _tokens(llm)
    llm.sleep(level=2)
    llm.wake_up()
    llm.load_weights(list(load_file(llama3_cuda_folder / "model.safetensors").items()))
    assert _tokens(llm) == before
    other = write_tiny_model(tmp_path / "other", "llama3", seed=7)
    llm.load_weights(list(load_file(other / "model.safetensors").items()))
    assert assert_greedy_matches(llm, hf_model(other), PROMPTS, NEW) >= len(PROMPTS) - 1


def test_sleep_with_awq_weights_on_gpu(llama3_cuda_folder, tmp_path):
    """The 4-bit kernels' packed tensors and split counters survive level 1 (bfloat16, graphs:
    the GEMV, mma and tile paths at the test's batch sizes)."""
    from tests.quant.packers import write_quantized_pair

    awq = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
           "version": "gemm"}
    write_quantized_pair(llama3_cuda_folder, tmp_path / "q", tmp_path / "f", awq)
    llm = make_llm(tmp_path / "q", device="cuda", dtype="bfloat16",
                   kv_cache_memory_bytes=64 << 20, enable_sleep_mode=True, max_num_seqs=8)
    before = _tokens(llm)
    llm.sleep(level=1)
    llm.wake_up()
    assert _tokens(llm) == before


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_preemption_resumes_exactly_on_gpu(llama3_cuda_folder, mode, options):
    """``--scheduling-policy priority`` on the GPU, graphs on: an urgent arrival preempts the
    running low-priority request (its blocks swapped to page-locked host memory, or dropped),
    and both end with the tokens each has alone."""
    from tests.engine.test_priority_scheduling import GREEDY, HIGH_PROMPT, LOW_PROMPT
    from tests.kv_checks import assert_pools_full, check_pools

    alone = make_llm(llama3_cuda_folder, device="cuda", dtype="float32", num_blocks=16)
    reference = [o.outputs[0].token_ids
                 for o in alone.generate([LOW_PROMPT, HIGH_PROMPT], GREEDY, use_tqdm=False)]
    llm = make_llm(llama3_cuda_folder, device="cuda", dtype="float32", num_blocks=4,
                   scheduling_policy="priority", preemption_mode=mode, swap_space=0.001,
                   **options)
    engine = llm.engine
    low = engine.add_request(LOW_PROMPT, GREEDY, priority=5)
    while engine.kv.pool.num_free > 2:
        engine.step()
    high = engine.add_request(HIGH_PROMPT, GREEDY, priority=-1)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        check_pools(engine.kv)
    assert_pools_full(engine.kv)
    assert engine.scheduler.num_preemptions > 0
    assert [done[low], done[high]] == reference


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_embeddings_match_transformers_on_gpu(tmp_path, pooling_type):
    """``runner="pooling"`` on the GPU (a bare ``LlamaModel`` checkpoint, float32) against
    transformers' hidden states pooled in float64. The tolerance is wider than the CPU's:
    Triton's float32 dots round their inputs to TF32."""
    from tests.tiny_models import hf_pooled

    folder = write_tiny_model(tmp_path / "m", "llama3", seed=3, base_model=True)
    llm = make_llm(folder, device="cuda", dtype="float32", runner="pooling",
                   pooler_config={"pooling_type": pooling_type, "normalize": True})
    prompts = random_prompts("cuda-embed", [1, 5, 23, 64, 97])
    outs = llm.embed(prompts, use_tqdm=False)
    want = hf_pooled(folder, prompts, pooling_type, normalize=True)
    for out, w in zip(outs, want, strict=True):
        got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
        assert got.shape == w.shape
        assert (got - w).abs().max().item() < 2e-3
