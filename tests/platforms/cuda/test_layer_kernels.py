"""The fused Triton layer ops (RMSNorm with residual add, SwiGLU, rotary) against the plain
torch ops they replace and a float64 reference.

Without CUDA they run under Triton's interpreter (tests/conftest.py picks it) in float32 and
float16; with CUDA bf16 and model-sized shapes join. In-place ops are checked to leave every
element outside their target untouched (v of a fused qkv, residual rows' neighbours).
"""

from __future__ import annotations

import pytest
import torch

from tests.devices import HAS_NVIDIA

pytest.importorskip("triton")

from pagedserve.models.layer_ops import LayerOps  # noqa: E402
from pagedserve.models.rotary import RotaryEmbedding  # noqa: E402
from pagedserve.platforms.cuda.layer_ops import TritonLayerOps  # noqa: E402

DEVICE = torch.device("cuda" if HAS_NVIDIA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_NVIDIA else [])
# Shapes (tokens, hidden): odd token counts, a hidden size that is not a power of two.
SHAPES = [(1, 64), (7, 96)] + ([(300, 4096), (33, 5120)] if HAS_NVIDIA else [])
# One rounding of the activation dtype, plus rsqrt's approximation in float32.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def randn(*shape, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=TOL[dtype],
                               atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_rms_norm_matches_float64_and_torch(dtype, tokens, hidden):
    x = randn(tokens, hidden, dtype=dtype, seed=1)
    weight = randn(hidden, dtype=dtype, seed=2)
    eps = 1e-5
    h = x.double()
    expected = weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = TritonLayerOps.rms_norm(x, weight, eps)
    close(out, expected, dtype)
    close(out, LayerOps.rms_norm(x, weight, eps), dtype)
    assert out.dtype == dtype and out.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_fused_add_rms_norm_writes_the_sum_into_residual(dtype, tokens, hidden):
    x = randn(tokens, hidden, dtype=dtype, seed=3)
    residual = randn(tokens, hidden, dtype=dtype, seed=4)
    weight = randn(hidden, dtype=dtype, seed=5)
    expected_out, expected_sum = LayerOps.rms_norm(x, weight, 1e-6, residual.clone())
    x_before = x.clone()
    out, new_residual = TritonLayerOps.rms_norm(x, weight, 1e-6, residual)
    assert new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(new_residual, expected_sum, rtol=0, atol=0)
    close(out, expected_out, dtype)
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 32), (5, 1500)] + ([(257, 14336)] if HAS_NVIDIA
                                                                 else []))
def test_silu_and_mul_matches_float64(dtype, tokens, inter):
    x = randn(tokens, 2 * inter, dtype=dtype, seed=6) * 4
    gate, up = x.double().chunk(2, dim=-1)
    expected = gate * torch.sigmoid(gate) * up
    out = TritonLayerOps.silu_and_mul(x)
    assert out.shape == (tokens, inter)
    close(out, expected, dtype)
    close(out, LayerOps.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 1, 64), (8, 8, 128)])
def test_rotary_rotates_views_of_fused_qkv_in_place(dtype, heads, kv_heads, head_dim):
    tokens = 9
    rope = RotaryEmbedding(head_dim, 2048, 500000.0, None, LayerOps)
    cos, sin = rope.cos.to(DEVICE), rope.sin.to(DEVICE)
    positions = torch.tensor([0, 1, 2, 7, 100, 1000, 2047, 5, 5], device=DEVICE)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=7)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = (t.view(tokens, -1, head_dim)
               for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    expected_q, expected_k = _rotate_float64(q, k, cos[positions], sin[positions])
    v_before = v.clone()
    reference_q, reference_k = LayerOps.rotary(positions, q, k, cos, sin)
    out_q, out_k = TritonLayerOps.rotary(positions, q, k, cos, sin)
    close(out_q, expected_q, dtype)
    close(out_k, expected_k, dtype)
    close(out_q, reference_q, dtype)
    close(out_k, reference_k, dtype)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(v, v_before, rtol=0, atol=0)


def _rotate_float64(q, k, cos, sin):
    """The rotation in float64 from the same float32 tables (whose own rounding, about 1e-4
    at position 2047, is the table's business, not the kernel's)."""
    cos, sin = cos.double()[:, None, :], sin.double()[:, None, :]

    def rotate(x):
        x1, x2 = x.double().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def test_the_platform_hands_out_the_fused_ops():
    from pagedserve.platforms.cuda.platform import CudaPlatform

    # The CPU's choice is tested in tests/platforms/cpu/test_layer_ops.py.
    assert CudaPlatform.layer_ops() is TritonLayerOps
