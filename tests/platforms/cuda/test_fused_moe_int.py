"""The Triton mixture-of-experts kernel reading integer expert weights (W4A16 and W8A16,
``INT_BITS`` of ``kernels/fused_moe.py``, ``PackedIntWeight`` stacks) against a float64 loop
over each token's top-k experts, on weights dequantized here from the codes, zero points and
scales by indexing each element's group (not by the forms' ``dequantize``).

The experts are made as the loaders leave them (``GroupQuantWeight``: codes, float32 scales
rounded to float16 as checkpoints store them, offsets ``-z * s``) and turned into the kernel's
layout by ``PackedIntWeight.from_group``, as ``IntExperts`` does at load: AWQ's zero points
(4-bit, any of 0..15), GPTQ's symmetric ones (``2**(bits - 1)``) and asymmetric 8-bit ones, in
groups of 32, 64 and 128 and one per row (``group_size: -1``), with partial last groups,
groups wider than the config's K tile and an odd K (a padded nibble). Scales vary by a factor
of 20 between groups. Without an NVIDIA GPU the kernel runs under Triton's interpreter in
float32 and float16; with one, bf16 and model-sized shapes join.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.devices import HAS_NVIDIA, choose_triton_interpreter, interpreter_guards
from tests.models.test_moe import reference_moe

IMPORTED_TOO_LATE = choose_triton_interpreter()
pytest.importorskip("triton")

if not IMPORTED_TOO_LATE:
    from pagedserve.models.layer_ops import LayerOps
    from pagedserve.platforms.cuda.kernels import fused_moe as moe
    from pagedserve.platforms.cuda.layer_ops import TritonLayerOps
    from pagedserve.quant.weights import GroupQuantWeight, PackedIntWeight
    from tests.platforms.cuda.test_fused_moe import routing
    from tests.platforms.cuda.test_fused_moe_fp8 import close, rounded_reference

_kernels_runnable, test_in_a_fresh_interpreter_process = interpreter_guards(
    __file__, IMPORTED_TOO_LATE)

DEVICE = torch.device("cuda" if HAS_NVIDIA else "cpu")


def int_stack(experts: int, n: int, k: int, bits: int, group: int, zeros: str, seed: int):
    """Random integer experts ``[E, N, K]`` in the kernel's layout and the float64 weights
    they stand for. ``group`` -1: one group a row; ``zeros``: "awq" (random, 0 .. 2**bits - 1)
    or "sym" (GPTQ's ``sym``: ``2**(bits - 1)``)."""
    g = torch.Generator().manual_seed(seed)
    group = k if group == -1 else group
    groups = -(-k // group)
    q = torch.randint(0, 2**bits, (experts, n, k), generator=g, dtype=torch.uint8)
    if zeros == "sym":
        z = torch.full((experts, n, groups), 2 ** (bits - 1))
    else:
        z = torch.randint(0, 2**bits, (experts, n, groups), generator=g)
    s = (torch.rand(experts, n, groups, generator=g) * 1.9 + 0.1) / (2 ** (bits - 1)
                                                                   * math.sqrt(k))
    s = s.half().float()
    of_column = torch.arange(k) // group
    dense = (q.double() - z.double()[..., of_column]) * s.double()[..., of_column]
    packed = PackedIntWeight.from_group(GroupQuantWeight(q, s, -z.float() * s, bits, group))
    return _on_device(packed), dense


def _on_device(w: PackedIntWeight) -> PackedIntWeight:
    return PackedIntWeight(w.values.to(DEVICE), w.scales.to(DEVICE), w.zeros.to(DEVICE),
                           w.bits, w.group_size, w.columns)


def problem(tokens, experts, top_k, hidden, inter, kind, bits, group, zeros, dtype):
    w13, dense13 = int_stack(experts, 2 * inter, hidden, bits, group, zeros, seed=1)
    w2, dense2 = int_stack(experts, hidden, inter, bits, group, zeros, seed=2)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3))
    ids, weights = routing(tokens, experts, top_k, kind)
    x = x.to(dtype)  # the reference starts from the kernel's input
    if dtype == torch.float32:
        expected = reference_moe(x.double(), dense13, dense2, ids.cpu(), weights.cpu())
    else:
        expected = rounded_reference(x, dense13, dense2, ids.cpu(), weights.cpu(), dtype)
    return (x.to(DEVICE), w13, w2, ids, weights), expected


# (tokens, experts, top_k, hidden, intermediate, routing, bits, group, zeros): H 160 in groups
# of 128 (a partial one) with I 96 in one group (w2 scaled per row); I 41 (odd K: a padded
# nibble, and a partial group of 32); groups of 128 wider than the K tile of 64 at float32.
SHAPES = [
    (1, 8, 2, 64, 48, "random", 4, 32, "awq"),
    (17, 16, 4, 128, 64, "half_idle", 4, 64, "awq"),
    (5, 8, 2, 160, 96, "random", 4, 128, "sym"),
    (9, 8, 2, 96, 80, "one_takes_all", 4, -1, "awq"),
    (3, 8, 2, 64, 41, "random", 4, 32, "awq"),
    (7, 8, 2, 64, 48, "random", 8, 32, "sym"),
    (4, 4, 1, 256, 64, "random", 8, 128, "awq"),
    (6, 8, 2, 64, 80, "half_idle", 8, -1, "sym"),
] + ([(1, 8, 2, 4096, 1792, "random", 4, 128, "awq"),
      (300, 128, 8, 2048, 768, "random", 4, 128, "sym"),
      (2048, 8, 2, 1024, 1792, "one_takes_all", 4, 64, "awq"),
      (64, 128, 8, 2048, 768, "random", 8, 128, "awq")] if HAS_NVIDIA else [])
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_NVIDIA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,kind,bits,group,zeros", SHAPES)
def test_int_experts_match_float64(tokens, experts, top_k, hidden, inter, kind, bits, group,
                                   zeros, dtype):
    args, expected = problem(tokens, experts, top_k, hidden, inter, kind, bits, group, zeros,
                             dtype)
    got = moe.fused_moe(*args)
    assert got.dtype == dtype and got.shape == args[0].shape
    close(got, expected, dtype)


def test_every_buffer_of_the_layer_is_written(monkeypatch):
    """The kernel's buffers (gate/up rows, each expert's down rows) start as NaN, so a row or
    column the kernels leave unwritten shows in the output."""
    args, expected = problem(17, 16, 4, 128, 64, "half_idle", 4, 32, "awq", torch.float32)
    empty, poisoned = torch.empty, []

    def nan_empty(*shape, **kwargs):
        t = empty(*shape, **kwargs)
        if t.is_floating_point():
            poisoned.append(t.fill_(float("nan")))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)
    got = moe.fused_moe(*args)
    assert len(poisoned) >= 2 and not got.isnan().any()
    close(got, expected, torch.float32)


def test_the_same_bits_every_run_and_no_tokens():
    args, _ = problem(17, 8, 2, 64, 48, "random", 4, 32, "awq", torch.float32)
    first = moe.fused_moe(*args)
    assert torch.equal(moe.fused_moe(*args), first)
    x, w13, w2, ids, weights = args
    assert moe.fused_moe(x[:0], w13, w2, ids[:0], weights[:0]).shape == (0, 64)


@pytest.mark.parametrize("misread", ["nibbles swapped", "zero points left out",
                                     "first group's scale"])
def test_a_misread_layout_fails_the_comparison(monkeypatch, misread):
    """The check sees each part of the layout: the two codes of a byte in the other order,
    the zero points left out, each row's first group scale for all of K."""
    args, expected = problem(9, 4, 2, 128, 64, "random", 4, 32, "awq", torch.float32)
    close(moe.fused_moe(*args), expected, torch.float32)
    x, w13, w2, ids, weights = args
    if misread == "nibbles swapped":
        w13 = PackedIntWeight(((w13.values << 4) | (w13.values >> 4)), w13.scales, w13.zeros,
                              4, 32, w13.columns)
    elif misread == "zero points left out":
        w13 = PackedIntWeight(w13.values, w13.scales, torch.zeros_like(w13.zeros), 4, 32,
                              w13.columns)
    else:
        operand = moe._operand

        def first_group_only(w, hidden, cfg):
            op = operand(w, hidden, cfg)
            if op.mode != "block":
                return op
            return op._replace(mode="row", scales=op.scales[..., :1].contiguous(),
                               zeros=op.zeros[..., :1].contiguous())

        monkeypatch.setattr(moe, "_operand", first_group_only)
    with pytest.raises(AssertionError):
        close(moe.fused_moe(x, w13, w2, ids, weights), expected, torch.float32)


def test_groups_no_tile_fits_are_refused():
    args, _ = problem(3, 4, 2, 48, 24, "random", 4, 24, "awq", torch.float32)
    with pytest.raises(ValueError, match="integer groups 24 columns wide"):
        moe.fused_moe(*args)


def test_the_platform_reads_integer_experts_with_the_kernel():
    assert TritonLayerOps.fused_moe_int is moe.fused_moe and LayerOps.fused_moe_int is None


@pytest.mark.slow
@pytest.mark.skipif(HAS_NVIDIA, reason="the CPU engine runs the kernel under the interpreter; "
                    "on a GPU, test_architectures_cuda.py's integer MoE test does")
def test_the_kernel_in_the_engine_gives_transformers_logprobs(tiny_model_folder, tmp_path,
                                                              monkeypatch):
    """The chain from an AWQ checkpoint to the kernel on the CPU: a tiny Mixtral's experts
    loaded into ``IntExperts`` and read by this kernel (under the interpreter) through the
    platform's ops, against transformers in float64 on the dequantized checkpoint."""
    from pagedserve.models.int_experts import IntExperts
    from pagedserve.models.moe import FusedExperts
    from pagedserve.platforms.cpu.platform import CpuPlatform
    from tests.models.test_quantized_moe import AWQ
    from tests.quant.packers import write_quantized_pair
    from tests.tiny_models import (
        hf_model_float64,
        make_llm,
        prompt_logprob_error,
        random_prompts,
    )

    write_quantized_pair(tiny_model_folder("mixtral"), tmp_path / "awq", tmp_path / "ref", AWQ)

    class Ops(CpuPlatform.layer_ops()):
        fused_moe_int = staticmethod(moe.fused_moe)

    monkeypatch.setattr(CpuPlatform, "layer_ops", classmethod(lambda cls: Ops))
    llm = make_llm(tmp_path / "awq", dtype="float32", enable_prefix_caching=False,
                   int8_activations=False)
    experts = [m.quantized for m in llm.engine.executor.runner.model.modules()
               if isinstance(m, FusedExperts)]
    assert experts and all(isinstance(q, IntExperts) for q in experts)
    prompt = random_prompts("int-kernel", [13])[0]
    assert prompt_logprob_error(llm, hf_model_float64(tmp_path / "ref"), prompt) < 1e-4
