"""The CPU's grouped-int linear method against float64 math on the dequantized weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.platforms.cpu.platform import CpuPlatform
from pagedserve.platforms.cpu.quant_linear import Int4PackLinearMethod
from pagedserve.quant.linear_method import DenseLinearMethod
from pagedserve.quant.weights import GroupQuantWeight
from tests.quant.group_weights import random_weight, reference

CASES = [  # n, k, bits, group
    (48, 64, 4, 32), (33, 100, 4, 32), (17, 256, 4, 128), (40, 96, 4, 96),
    (64, 576, 4, 576), (48, 64, 8, 32), (31, 160, 8, 64), (24, 128, 8, 128),
]


@pytest.mark.parametrize("n, k, bits, group", CASES)
@pytest.mark.parametrize("m", [1, 3, 300])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_matches_float64(n, k, bits, group, m, dtype, tol) -> None:
    w = random_weight(n, k, bits, group, seed=n * k + bits)
    layer = nn.Module()
    Int4PackLinearMethod().create_weights(layer, w, dtype, torch.device("cpu"))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = Int4PackLinearMethod().apply(layer, x)
    assert out.dtype == dtype and out.shape == (m, n)
    expected = reference(x, w)
    err = (out.double() - expected).abs().max() / expected.abs().max()
    assert err < tol


def test_act_order_permutes_the_input() -> None:
    w = random_weight(40, 128, 4, 32, seed=3, act_order=True)
    layer = nn.Module()
    Int4PackLinearMethod().create_weights(layer, w, torch.float32, torch.device("cpu"))
    x = torch.randn(5, 128)
    out = Int4PackLinearMethod().apply(layer, x)
    expected = reference(x, w)
    assert (out.double() - expected).abs().max() / expected.abs().max() < 2e-5
    # Ignoring the permutation would be far off.
    unpermuted = reference(x, GroupQuantWeight(w.values, w.scales, w.offsets, 4, 32))
    assert (unpermuted - expected).abs().max() / expected.abs().max() > 0.1


def test_the_platform_prefers_the_native_kernel(monkeypatch) -> None:
    from pagedserve.platforms.cpu import native_quant
    from pagedserve.platforms.cpu.quant_linear import NativeQuantLinearMethod

    w = random_weight(16, 64, 4, 32, seed=1)
    assert native_quant.available()  # CI has a C compiler
    assert isinstance(CpuPlatform.linear_method(w), NativeQuantLinearMethod)
    monkeypatch.setattr(native_quant, "available", lambda: False)
    assert isinstance(CpuPlatform.linear_method(w), Int4PackLinearMethod)


def test_without_the_native_kernel_groups_int4pack_cannot_split_are_dequantized(
        monkeypatch) -> None:
    from pagedserve.platforms.cpu import native_quant

    monkeypatch.setattr(native_quant, "available", lambda: False)
    w = random_weight(16, 48, 4, 48, seed=1)  # 48 is not a multiple of 32
    method = CpuPlatform.linear_method(w)
    assert isinstance(method, DenseLinearMethod)
    layer = nn.Module()
    method.create_weights(layer, w, torch.float32, torch.device("cpu"))
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(2))
    expected = reference(x, w)
    # float32 rounding, as in test_matches_float64 (a fixed 1e-7 absolute bound failed on a
    # 1.1e-7 difference, depending on which x the global generator had left).
    assert (method.apply(layer, x).double() - expected).abs().max() / expected.abs().max() < 2e-5
