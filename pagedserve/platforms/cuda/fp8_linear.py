"""W8A8 FP8 linear layers: FP8 weights times activations quantized to FP8 on the fly, in the
GPU's FP8 tensor cores through ``torch._scaled_mm``.

Layout the matmul reads (built once by ``create_weights``):

- ``fp8_weight``: ``[N', K']`` in the platform's FP8 type, row-major, so its transpose is the
  column-major ``[K', N']`` operand ``_scaled_mm`` wants. ``K'`` and ``N'`` are ``K`` and ``N``
  rounded up to multiples of 16 (the kernel's alignment), padded with zeros; the activations'
  quantization writes the padded columns as zeros, and the extra output columns are sliced off.
- ``fp8_weight_scale``: float32 ``[1, N']`` (padding scales are 1), or a 0-dim tensor when every
  row shares one scale and the activations have a static scale: then both scales are
  per-tensor, the one case where ``_scaled_mm`` takes any output dtype.
- ``fp8_input_scale``: the static activation scale as a 0-dim float32 tensor, or None (a scale
  per token, computed by the quantization kernel).

With row-wise scales ``_scaled_mm`` writes bfloat16 only (its CUTLASS kernel is
``f8f8bf16_rowwise``), so other activation dtypes get the unscaled product in float32 and apply
both scales after it. Up to ``fp8_gemv.MAX_M`` rows (decode at small batch) take the FP8 GEMV
kernel instead, which keeps the activations unquantized. ``apply`` never waits on the device,
so it can be captured in a CUDA graph.

Above those rows the layer's ``input_quantizer`` lets the RMSNorm or the SwiGLU before it write
the FP8 activations and their scales directly (``rms_norm_fp8``, ``silu_and_mul_fp8``), the same
values the standalone quantization would give. The layer after attention quantizes its input
itself.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.platforms.cuda.kernels import fp8_gemv
from pagedserve.platforms.cuda.kernels.activation import (
    MAX_FUSED_COLUMNS,
    silu_and_mul,
    silu_and_mul_fp8,
)
from pagedserve.platforms.cuda.kernels.fp8_quant import quantize_per_token, quantize_static
from pagedserve.platforms.cuda.kernels.rms_norm import rms_norm_fp8
from pagedserve.quant.linear_method import InputQuantizer, LinearMethod, QuantizedActivation
from pagedserve.quant.weights import Fp8Weight

_ALIGN = 16


class Fp8LinearMethod(LinearMethod):
    """``fast_accumulation``: ``scaled_mm``'s, the engine's ``--fp8-fast-accumulation``."""

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                 fast_accumulation: bool = True) -> None:
        self.fp8_dtype = fp8_dtype
        self.fast_accumulation = fast_accumulation

    def create_weights(self, layer, weight: Fp8Weight, dtype, device) -> None:
        values, scales, input_scale = weight.values, weight.scales.float(), weight.input_scale
        if self.fp8_dtype == torch.float8_e4m3fnuz:
            values, scales, input_scale = to_e4m3fnuz(values, scales, input_scale)
        n, k = values.shape
        per_tensor = input_scale is not None and bool((scales == scales[0]).all())
        padded = _pad_values(values, _round_up(n), _round_up(k))
        _param(layer, "fp8_weight", padded.to(device))
        _param(layer, "fp8_weight_scale",
               (scales[0].reshape(()) if per_tensor else _pad_scales(scales, padded.shape[0]))
               .to(device))
        layer.fp8_input_scale = (None if input_scale is None else
                                 nn.Parameter(torch.tensor(float(input_scale), device=device),
                                              requires_grad=False))
        layer.fp8_out_features = n

    def input_quantizer(self, layer, num_tokens):
        if num_tokens <= fp8_gemv.MAX_M:  # the GEMV reads the activations as they are
            return None
        return Fp8InputQuantizer(layer.fp8_weight.dtype, layer.fp8_weight.shape[1],
                                 layer.fp8_input_scale)

    def apply(self, layer, x):
        wq, w_scale = layer.fp8_weight, layer.fp8_weight_scale
        if isinstance(x, QuantizedActivation):
            quantized, lead = x, x.values.shape[:-1]
        else:
            x2, lead = x.reshape(-1, x.shape[-1]).contiguous(), x.shape[:-1]
            if x2.shape[0] <= fp8_gemv.MAX_M:  # decode at batch 1-4: stream the weight
                out = fp8_gemv.matmul(x2, wq, w_scale, layer.fp8_out_features)
                return out.reshape(*lead, out.shape[1])
            quantized = self.input_quantizer(layer, x2.shape[0]).quantize(x2)
        x_scale = quantized.scales
        if x_scale.dim() == 0 and w_scale.dim() != 0:  # static activation scale, row-wise weight
            x_scale = x_scale.expand(quantized.values.shape[0], 1).contiguous()
        out = scaled_mm(quantized.values, wq.t(), x_scale, w_scale, quantized.dtype,
                        self.fast_accumulation)
        if out.shape[1] != layer.fp8_out_features:
            out = out[:, :layer.fp8_out_features]
        return out.reshape(*lead, out.shape[1])


class Fp8InputQuantizer(InputQuantizer):
    """Activations to ``fp8_dtype`` with ``padded_k`` columns (the weight's padded K): a
    dynamic scale per token, or the checkpoint's static ``input_scale``."""

    def __init__(self, fp8_dtype: torch.dtype, padded_k: int,
                 static_scale: torch.Tensor | None) -> None:
        self.fp8_dtype = fp8_dtype
        self.padded_k = padded_k
        self.static_scale = static_scale

    def quantize(self, x: torch.Tensor) -> QuantizedActivation:
        """The standalone quantization, for activations no fused op produced."""
        if self.static_scale is None:
            q, scales = quantize_per_token(x, self.fp8_dtype, self.padded_k)
        else:
            q = quantize_static(x, self.static_scale, self.fp8_dtype, self.padded_k)
            scales = self.static_scale
        return QuantizedActivation(q, scales, x.dtype)

    def rms_norm(self, x, weight, eps, residual=None):
        q, scales = rms_norm_fp8(x, weight, eps, residual, self.fp8_dtype, self.padded_k,
                                 self.static_scale)
        quantized = QuantizedActivation(q, scales, x.dtype)
        return quantized if residual is None else (quantized, residual)

    def silu_and_mul(self, x):
        if self.padded_k > MAX_FUSED_COLUMNS:  # too wide a row for one program's registers
            return self.quantize(silu_and_mul(x))
        q, scales = silu_and_mul_fp8(x, self.fp8_dtype, self.padded_k, self.static_scale)
        return QuantizedActivation(q, scales, x.dtype)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, fast_accumulation: bool) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` in ``out_dtype``: ``a [M, K]`` row-major, ``b [K, N]``
    column-major, scales 0-dim (per tensor) or ``[M, 1]`` and ``[1, N]`` (per row).

    ``fast_accumulation``: on Hopper the FP8 tensor cores' own accumulator (fewer mantissa bits
    than float32) runs the whole K loop, with no promotion to float32 registers every few
    k-steps, as in vLLM's FP8 CUTLASS kernels (their ``FP8FastAccum`` schedules). cuBLASLt
    and torch's row-wise CUTLASS kernel take it as a flag (hipBLASLt takes the same
    attribute; never run on an AMD GPU here). What it gains and costs: docs/quantization.md."""
    if scale_b.dim() == 0 or out_dtype == torch.bfloat16:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                use_fast_accum=fast_accumulation)
    one = torch.ones((), dtype=torch.float32, device=a.device)
    out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32,
                           use_fast_accum=fast_accumulation)
    return (out * scale_a * scale_b).to(out_dtype)


def to_e4m3fnuz(values: torch.Tensor, scales: torch.Tensor,
                input_scale: float | None) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """An e4m3fn weight re-read as e4m3fnuz (MI300's FP8), the same bits: fnuz's exponent bias
    is one larger, so each value reads as half of itself and the scales double (the activations'
    static scale too, keeping ``x / scale`` within fnuz's 240). The one pattern that differs,
    0x80, is fn's -0 and fnuz's NaN: it becomes +0."""
    bits = values.view(torch.int8).clone()
    bits[bits == -128] = 0
    return (bits.view(torch.float8_e4m3fnuz), scales * 2,
            None if input_scale is None else input_scale * 2)


def _pad_values(values: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if values.shape == (rows, cols):
        return values.contiguous()
    padded = torch.zeros((rows, cols), dtype=torch.uint8, device=values.device)
    padded[:values.shape[0], :values.shape[1]] = values.view(torch.uint8)
    return padded.view(values.dtype)


def _pad_scales(scales: torch.Tensor, columns: int) -> torch.Tensor:
    padded = torch.ones((1, columns), dtype=torch.float32, device=scales.device)
    padded[0, :scales.shape[0]] = scales
    return padded


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _param(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    # A parameter (never trained), so weight byte counts include it.
    setattr(layer, name, nn.Parameter(tensor, requires_grad=False))
