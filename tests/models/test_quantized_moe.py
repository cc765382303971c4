"""Mixture-of-experts checkpoints with quantized experts (block FP8 as Qwen3-FP8 stores it,
per-tensor FP8 in vLLM's and compressed-tensors' layouts, AWQ and GPTQ 4-bit) and
``--quantization fp8``: the experts stay quantized in memory, and the engine in float32 gives
transformers' greedy tokens and prompt logprobs on the same weights dequantized independently,
in float64. An expert given its neighbour's scales, or a block grid read the wrong way round,
moves the logprobs far off, so the comparisons see the experts' scales. FP8 and integer experts
that a platform reads as they are (``models/kernel_experts.py``) are checked through a stand-in
platform whose entry points dequantize the layouts they are given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.config import ConfigError
from pagedserve.distributed import Part
from pagedserve.models import moe
from pagedserve.models.fp8_experts import Fp8Experts
from pagedserve.models.int_experts import IntExperts
from pagedserve.models.layer_ops import LayerOps
from pagedserve.models.moe import FusedExperts, RoutedExperts
from pagedserve.models.quantized_experts import QuantizedExperts
from pagedserve.platforms.cpu.platform import CpuPlatform
from pagedserve.quant.expert_stack import ExpertStack, pack_nibbles, unpack_nibbles
from pagedserve.quant.weights import BlockFp8Weight, Fp8Weight, GroupQuantWeight
from tests.graph_stubs import record_graphs
from tests.quant.fp8_ct_checkpoints import (
    write_block_fp8,
    write_compressed_tensors_fp8,
    write_fp8,
    write_fp8_at_load_reference,
)
from tests.quant.group_weights import random_weight
from tests.quant.packers import write_quantized_pair
from tests.tiny_models import (
    assert_greedy_matches,
    hf_model_float64,
    make_llm,
    prompt_logprob_error,
    random_prompts,
)

ARCHS = ["mixtral", "qwen3-moe"]
# Mixtral's 48 expert rows in blocks of 32: the last block of each gate/up row partial, and
# of each down column.
BLOCK = (32, 32)
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
       "version": "gemm"}
GPTQ_ACT_ORDER = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False,
                  "desc_act": True, "checkpoint_format": "gptq"}
# Read as they are by a platform with ``fused_moe_int`` (GPTQ's symmetric 4-bit groups, and
# asymmetric 8-bit with one group a row in the v2 layout).
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
        "checkpoint_format": "gptq"}
GPTQ_8BIT = {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False,
             "desc_act": False, "checkpoint_format": "gptq_v2"}
ROUTERS = ("re:.*block_sparse_moe\\.gate$", "re:.*mlp\\.gate$")
FORMATS = ["block-fp8", "fp8-static", "compressed-tensors-fp8", "awq", "gptq-act-order"]
# The form every expert stack holds, by format.
FORMS = {"block-fp8": BlockFp8Weight, "fp8-static": Fp8Weight,
         "compressed-tensors-fp8": Fp8Weight, "awq": GroupQuantWeight,
         "gptq-act-order": GroupQuantWeight}


def _write(fmt: str, src: Path, dst: Path) -> tuple[Path, Path]:
    """The quantized checkpoint of ``src`` in ``fmt``, and its float32 reference folder."""
    if fmt == "block-fp8":
        ckpt = write_block_fp8(src, dst, BLOCK)
    elif fmt == "fp8-static":
        ckpt = write_fp8(src, dst, static=True)
    elif fmt == "compressed-tensors-fp8":
        ckpt = write_compressed_tensors_fp8(src, dst, ("lm_head", *ROUTERS))
    else:
        config = {"awq": AWQ, "gptq": GPTQ, "gptq-8bit": GPTQ_8BIT}.get(fmt, GPTQ_ACT_ORDER)
        write_quantized_pair(src, dst / fmt, dst / "reference", config)
        return dst / fmt, dst / "reference"
    return ckpt.quantized, ckpt.reference


def _expert_stacks(llm) -> list[ExpertStack]:
    model = llm.engine.executor.runner.model
    return [s for m in model.modules() if isinstance(m, FusedExperts)
            for s in (m.quantized.gate, m.quantized.up, m.quantized.down)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_matches_transformers_on_dequantized_experts(tiny_model_folder, tmp_path, arch,
                                                            fmt):
    quantized, reference = _write(fmt, tiny_model_folder(arch), tmp_path)
    llm = make_llm(quantized, dtype="float32", block_size=8,
                   max_num_batched_tokens=16, enable_prefix_caching=False,
                   int8_activations=False)
    stacks = _expert_stacks(llm)
    assert stacks and all(s.form is FORMS[fmt] for s in stacks)
    experts = [m for m in llm.engine.executor.runner.model.modules()
               if isinstance(m, FusedExperts)]
    assert all(m.w13 is None for m in experts)  # no 16-bit copy of the experts
    hf = hf_model_float64(reference)
    prompts = random_prompts(f"{arch}-{fmt}", [37, 9])
    assert max(prompt_logprob_error(llm, hf, p) for p in prompts) < 1e-4
    assert assert_greedy_matches(llm, hf, prompts, new_tokens=10) >= 1
    # Each expert given its neighbour's down-projection scales.
    for stack in stacks[2::3]:
        stack.scales.copy_(stack.scales.roll(1, dims=0))
    assert prompt_logprob_error(llm, hf, prompts[0]) > 1e-2


def test_block_scales_on_the_wrong_tiles_are_seen(tiny_model_folder, tmp_path):
    """Qwen3-MoE's expert gate projections, 32 x 64 in blocks of 32: each expert's two
    scales swapped (a grid read the wrong way round) move the logprobs far off."""
    reference = write_block_fp8(tiny_model_folder("qwen3-moe"), tmp_path, BLOCK).reference
    llm = make_llm(tmp_path / "block-fp8", dtype="float32", enable_prefix_caching=False)
    hf = hf_model_float64(reference)
    prompt = random_prompts("transposed", [23])[0]
    assert prompt_logprob_error(llm, hf, prompt) < 1e-4
    for stack in _expert_stacks(llm)[0::3]:  # gate: [E, 1, 2] grids
        stack.scales.copy_(stack.scales.flip(-1))
    assert prompt_logprob_error(llm, hf, prompt) > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_quantization_fp8_at_load_quantizes_the_experts(tiny_model_folder, tmp_path, arch):
    """``--quantization fp8`` on a float MoE checkpoint: the experts become FP8 with a scale
    per output row, as the dense layers do (the router and LM head stay float)."""
    ckpt = write_fp8_at_load_reference(tiny_model_folder(arch), tmp_path)
    llm = make_llm(ckpt.quantized, dtype="float32", quantization="fp8",
                   enable_prefix_caching=False)
    assert all(s.form is Fp8Weight for s in _expert_stacks(llm))
    hf = hf_model_float64(ckpt.reference)
    prompts = random_prompts(f"{arch}-at-load", [31, 6])
    assert max(prompt_logprob_error(llm, hf, p) for p in prompts) < 1e-4
    assert assert_greedy_matches(llm, hf, prompts, new_tokens=10) >= 1


def test_dequantized_active_experts_run_the_platform_op():
    """Only the experts a step routes tokens to are dequantized (GPTQ act-order up
    projections, each expert's columns in its own order), and the platform's op gets them
    renumbered 0 .. A-1, with the routing weights unchanged."""
    experts = FusedExperts(6, 64, Part.whole(32), torch.float32, torch.device("cpu"))
    dense = {}
    for e in range(6):
        for i, (proj, n, k) in enumerate((("gate", 32, 64), ("up", 32, 64), ("down", 64, 32))):
            w = random_weight(n, k, 4, 32, seed=3 * e + i, act_order=proj == "up")
            experts.load(e, proj, w)
            dense[e, proj] = w.dequantize()
    seen = {}

    class Spy(LayerOps):
        @classmethod
        def fused_moe(cls, hidden, w13, w2, ids, weights):
            seen.update(w13=w13, w2=w2, ids=ids)
            return super().fused_moe(hidden, w13, w2, ids, weights)

    ids = torch.tensor([[4, 1], [1, 4], [5, 1]])
    routed = RoutedExperts(torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]]), ids)
    x = torch.randn(3, 64)
    out = experts(Spy, x, routed)
    assert seen["ids"].tolist() == [[1, 0], [0, 1], [2, 0]] and seen["w13"].shape[0] == 3
    for local, e in enumerate([1, 4, 5]):
        torch.testing.assert_close(seen["w13"][local],
                                   torch.cat([dense[e, "gate"], dense[e, "up"]]))
        torch.testing.assert_close(seen["w2"][local], dense[e, "down"])
    w13 = torch.stack([torch.cat([dense[e, "gate"], dense[e, "up"]]) for e in range(6)])
    w2 = torch.stack([dense[e, "down"] for e in range(6)])
    torch.testing.assert_close(out, LayerOps.fused_moe(x, w13, w2, ids, routed.weights))


def test_four_bit_expert_values_are_held_two_to_a_byte():
    stack = ExpertStack(3, torch.device("cpu"))
    weights = [random_weight(8, 33, 4, 32, seed=e) for e in range(3)]  # odd K: a padded byte
    for e, w in enumerate(weights):
        stack.put(e, w)
    assert stack.values.shape == (3, 8, 17) and stack.values.dtype == torch.uint8
    taken = stack.take(torch.tensor([2, 0]))
    for got, w in zip(taken.dequantize(), (weights[2], weights[0])):
        assert torch.equal(got, w.dequantize())
    values = torch.randint(0, 16, (4, 9), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(values), 9), values)
    stacked = GroupQuantWeight(*(torch.stack([getattr(w, f) for w in weights])
                                 for f in ("values", "scales", "offsets")), 4, 32)
    held = ExpertStack.holding(stacked)  # a stack made whole: the same bytes
    assert torch.equal(held.values, stack.values) and torch.equal(
        held.whole().dequantize(), stack.whole().dequantize())


def test_experts_of_different_forms_in_one_layer_are_refused():
    stack = ExpertStack(2, torch.device("cpu"))
    stack.put(0, random_weight(8, 64, 4, 32, seed=0))
    with pytest.raises(ValueError, match=r"expert 1 is GroupQuantWeight \(bits 4, group_size "
                                         r"64\), another expert .* group_size 32"):
        stack.put(1, random_weight(8, 64, 4, 64, seed=1))
    experts = FusedExperts(2, 64, Part.whole(8), torch.float32, torch.device("cpu"))
    experts.load(0, "gate", random_weight(8, 64, 4, 32, seed=0))
    with pytest.raises(ValueError, match="expert 1's gate projection is float, unlike others"):
        experts.load(1, "gate", torch.randn(8, 64))


_FP8_ZEROS = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("proj,weight,message", [
    ("gate", BlockFp8Weight(_FP8_ZEROS, torch.ones(2, 2), (32, 32)),
     "16 output rows of a column-parallel layer do not fall on the FP8 blocks of 32"),
    ("down", BlockFp8Weight(_FP8_ZEROS, torch.ones(2, 2), (32, 32)),
     "16 input columns of a row-parallel layer do not fall on the FP8 blocks of 32"),
    ("down", random_weight(64, 64, 4, 32, seed=0),
     "16 input columns of a row-parallel layer do not fall on the quantization groups of 32"),
    ("down", random_weight(64, 64, 4, 16, seed=0, act_order=True), "act-order"),
])
def test_a_rank_cut_inside_a_block_or_group_is_refused(proj, weight, message):
    """Rank 1 of 4 of 64 expert rows: 16 each, inside a block or group of 32 (act-order:
    the columns are not in groups at all)."""
    experts = FusedExperts(2, 64, Part(64, 16, 16), torch.float32, torch.device("cpu"))
    with pytest.raises(ConfigError, match=message):
        experts.load(0, proj, weight)


def test_quantized_experts_keep_graphs_off_where_the_platform_op_would_not(
        tiny_model_folder, tmp_path, monkeypatch):
    """A platform whose ``fused_moe`` runs in graphs captures them for float experts, but
    never for quantized ones: their step reads the routed experts on the host."""
    write_block_fp8(tiny_model_folder("mixtral"), tmp_path, BLOCK)
    runners = {name: make_llm(folder, kv_cache_memory_bytes=1 << 20).engine.executor.runner
               for name, folder in (("float", tiny_model_folder("mixtral")),
                                    ("quantized", tmp_path / "block-fp8"))}
    for runner in runners.values():
        monkeypatch.setattr(runner.platform.layer_ops(), "fused_moe_in_graphs", True)
    assert not moe.syncs_with_host(runners["float"].model)
    assert moe.syncs_with_host(runners["quantized"].model)
    for name, runner in runners.items():
        made = record_graphs(monkeypatch, runner.platform)
        runner.capture_graphs(max_num_seqs=4)
        assert bool(made) == (name == "float")
        runner.graphs = None


def _dequantizing(hidden, w13, w2, ids, weights):
    ReadsAsStored.seen.update(w13=w13, w2=w2)
    return LayerOps.fused_moe(hidden, w13.dequantize(), w2.dequantize(), ids, weights)


class ReadsAsStored(LayerOps):
    """A platform whose ops read FP8 and integer experts as they are: here by dequantizing the
    forms they are given (the Triton kernel is checked against float64 in
    tests/platforms/cuda/test_fused_moe_fp8.py and test_fused_moe_int.py)."""
    fused_moe_in_graphs = True
    seen: dict = {}
    fused_moe_fp8 = staticmethod(_dequantizing)
    fused_moe_int = staticmethod(_dequantizing)


def _fp8_expert(form: str, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(n, k, generator=g) * 32).to(torch.float8_e4m3fn)
    if form == "per-row":
        return Fp8Weight(values, torch.rand(n, generator=g) / 32 + 1e-3)
    block = (32, 32) if form == "block-32" else (16, 32)
    grid = (-(-n // block[0]), -(-k // block[1]))
    return BlockFp8Weight(values, torch.rand(grid, generator=g) / 32 + 1e-3, block)


@pytest.mark.parametrize("form", ["per-row", "block-32", "block-16"])
def test_fp8_experts_are_fused_once_for_a_platform_that_reads_them(form):
    """48 expert rows: blocks of 32 straddle the gate/up seam (a row of scales per row), blocks
    of 16 do not (the grids concatenate); the fused forms dequantize to each expert's gate
    rows then up rows, and the layer gives the dequantize path's result without the stacks;
    weights loaded again later (``LLM.load_weights``) land in the fused layout."""
    loaded = {}
    layers = [FusedExperts(4, 64, Part.whole(48), torch.float32, torch.device("cpu"),
                           reads=(Fp8Experts,) if reads else ()) for reads in (True, False)]

    def load_all(seed):
        for e in range(4):
            for i, (proj, n, k) in enumerate((("gate", 48, 64), ("up", 48, 64),
                                              ("down", 64, 48))):
                loaded[e, proj] = _fp8_expert(form, n, k, seed=seed + 3 * e + i)
                for layer in layers:
                    layer.load(e, proj, loaded[e, proj])

    load_all(0)
    fused, per_step = layers
    assert isinstance(fused.quantized, Fp8Experts) and not fused.syncs_with_host
    assert isinstance(per_step.quantized, QuantizedExperts) and per_step.syncs_with_host
    assert {n for n, _ in fused.named_parameters()} == {
        "quantized.w13.values", "quantized.w13.scales", "quantized.w2.values",
        "quantized.w2.scales"}
    ids = torch.tensor([[3, 1], [1, 0], [2, 3]])
    routed = RoutedExperts(torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]]), ids)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    out = fused(ReadsAsStored, x, routed)
    for e in range(4):
        assert torch.equal(ReadsAsStored.seen["w13"].dequantize()[e], torch.cat(
            [loaded[e, "gate"].dequantize(), loaded[e, "up"].dequantize()]))
        assert torch.equal(ReadsAsStored.seen["w2"].dequantize()[e], loaded[e, "down"].dequantize())
    torch.testing.assert_close(out, per_step(LayerOps, x, routed))
    load_all(100)
    changed = fused(ReadsAsStored, x, routed)
    torch.testing.assert_close(changed, per_step(LayerOps, x, routed))
    assert not torch.allclose(changed, out)


def _load_layer(layers, make, experts, rows, hidden, seed=0, part=None):
    """Every expert's gate, up (``[rows, hidden]``) and down projection made by ``make(n, k,
    seed)``, loaded into each of ``layers``; the weights by ``(expert, proj)``."""
    loaded = {}
    for e in range(experts):
        for i, (proj, n, k) in enumerate((("gate", rows, hidden), ("up", rows, hidden),
                                          ("down", hidden, rows))):
            loaded[e, proj] = make(n, k, seed + 3 * e + i)
            for layer in layers:
                layer.load(e, proj, loaded[e, proj])
    return loaded


@pytest.mark.parametrize("why,make", [
    ("no integer zero points (GGUF Q4_1)", lambda n, k, seed: random_weight(n, k, 4, 32, seed)),
    ("act-order", lambda n, k, seed: random_weight(n, k, 4, 32, seed, act_order=True,
                                                   zero_points=True)),
    ("groups of 24", lambda n, k, seed: random_weight(n, k, 4, 24, seed, zero_points=True)),
])
def test_integer_experts_that_the_kernel_cannot_read_stay_on_the_dequantize_path(why, make):
    experts = FusedExperts(2, 48, Part.whole(48), torch.float32, torch.device("cpu"),
                           reads=(Fp8Experts, IntExperts))
    _load_layer([experts], make, 2, 48, 48)
    assert isinstance(experts.quantized, QuantizedExperts) and experts.syncs_with_host


ROUTED = RoutedExperts(torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]]),
                       torch.tensor([[3, 1], [1, 0], [2, 3]]))


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 16), (4, -1)])
def test_int_experts_are_fused_once_for_a_platform_that_reads_them(bits, group):
    """AWQ/GPTQ-style experts (integer zero points; ``-1``: one group a row): the fused forms
    dequantize to each expert's gate rows then up rows, exactly, and the layer gives the
    dequantize path's result without the stacks; weights loaded again later
    (``LLM.load_weights``) land in the fused layout."""
    layers = [FusedExperts(4, 64, Part.whole(48), torch.float32, torch.device("cpu"),
                           reads=reads) for reads in ((Fp8Experts, IntExperts), ())]

    def make(n, k, seed):
        return random_weight(n, k, bits, k if group == -1 else group, seed, zero_points=True)

    loaded = _load_layer(layers, make, 4, 48, 64)
    fused, per_step = layers
    assert isinstance(fused.quantized, IntExperts) and not fused.syncs_with_host
    assert isinstance(per_step.quantized, QuantizedExperts)
    assert {n for n, _ in fused.named_parameters()} == {
        f"quantized.{w}.{t}" for w in ("w13", "w2") for t in ("values", "scales", "zeros")}
    assert fused.quantized.w13.values.shape == (4, 96, 64 * bits // 8)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    out = fused(ReadsAsStored, x, ROUTED)
    for e in range(4):
        assert torch.equal(ReadsAsStored.seen["w13"].dequantize()[e], torch.cat(
            [loaded[e, "gate"].dequantize(), loaded[e, "up"].dequantize()]))
        assert torch.equal(ReadsAsStored.seen["w2"].dequantize()[e],
                           loaded[e, "down"].dequantize())
    torch.testing.assert_close(out, per_step(LayerOps, x, ROUTED))
    _load_layer(layers, make, 4, 48, 64, seed=100)
    changed = fused(ReadsAsStored, x, ROUTED)
    torch.testing.assert_close(changed, per_step(LayerOps, x, ROUTED))
    assert not torch.allclose(changed, out)
    with pytest.raises(ValueError, match="integer zero points"):  # reloaded: no such layout
        fused.load(0, "up", random_weight(48, 64, bits, 32, seed=1))


@pytest.mark.parametrize("group", [32, -1])
def test_int_experts_of_a_tensor_parallel_rank(group):
    """Rank 1 of 2 of 64 expert rows: gate and up cut by rows, down by columns on the groups'
    bounds (one group a row: a group of the rank's 32 columns); the rank's fused experts give
    its dequantize path's partial sum."""
    layers = [FusedExperts(4, 64, Part(64, 32, 32), torch.float32, torch.device("cpu"),
                           reads=reads) for reads in ((IntExperts,), ())]

    def make(n, k, seed):
        return random_weight(n, k, 4, k if group == -1 else group, seed, zero_points=True)

    _load_layer(layers, make, 4, 64, 64)
    fused, per_step = layers
    assert isinstance(fused.quantized, IntExperts)
    assert fused.quantized.w2.whole().shape == (4, 64, 32)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(fused(ReadsAsStored, x, ROUTED), per_step(LayerOps, x, ROUTED))


@pytest.mark.parametrize("arch,fmt,layout", [
    ("mixtral", "block-fp8", Fp8Experts), ("mixtral", "fp8-static", Fp8Experts),
    ("mixtral", "awq", IntExperts), ("qwen3-moe", "gptq", IntExperts),
    ("mixtral", "gptq-8bit", IntExperts)])
def test_experts_read_as_they_are_give_transformers_tokens_and_graphs(
        tiny_model_folder, tmp_path, monkeypatch, arch, fmt, layout):
    """Through the engine on a platform whose ops read FP8 and integer experts (Mixtral's 48
    expert rows in FP8 blocks of 32: partial blocks at every edge of the block grids; in AWQ
    groups of 32: a partial last group of the down projections): the layers take graphs, and
    give transformers' tokens on the dequantized weights, which a neighbour's scales move far
    off."""
    quantized, reference = _write(fmt, tiny_model_folder(arch), tmp_path)

    class Ops(CpuPlatform.layer_ops(), ReadsAsStored):
        pass

    monkeypatch.setattr(CpuPlatform, "layer_ops", classmethod(lambda cls: Ops))
    # The dense integer layers in float32 (the CPU's default quantizes their activations).
    llm = make_llm(quantized, dtype="float32", enable_prefix_caching=False,
                   kv_cache_memory_bytes=1 << 20, int8_activations=False)
    runner = llm.engine.executor.runner
    experts = [m for m in runner.model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(isinstance(m.quantized, layout) for m in experts)
    assert not moe.syncs_with_host(runner.model)
    hf = hf_model_float64(reference)
    prompts = random_prompts(f"fused-{fmt}", [29, 7])
    assert max(prompt_logprob_error(llm, hf, p) for p in prompts) < 1e-4
    assert assert_greedy_matches(llm, hf, prompts, new_tokens=8) >= 1
    made = record_graphs(monkeypatch, runner.platform)
    runner.capture_graphs(max_num_seqs=4)
    assert made
    runner.graphs = None
    for m in experts:  # each expert given its neighbour's down-projection scales
        m.quantized.w2.scales.copy_(m.quantized.w2.scales.roll(1, dims=0))
    assert prompt_logprob_error(llm, hf, prompts[0]) > 1e-2
