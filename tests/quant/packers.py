"""AWQ and GPTQ checkpoints for tests: quantize a float weight, pack it in the on-disk layout,
and know its exact dequantized weight.

The packers follow the formats as AutoAWQ and AutoGPTQ write them (see the docstrings of
``pagedserve.quant.formats.awq`` and ``.gptq``), in arithmetic of their own: word by word sums of
shifted fields, never pagedserve's unpacking code. ``spec_values``/``spec_zeros`` read single
fields back with plain Python integers. test_awq.py and test_gptq.py check both against words
that AutoAWQ 0.2.9 and AutoGPTQ 0.7.1 packed (scripts/xcheck_awq_gptq_packers.py makes them,
and checks the packers against those packages' own code on random weights, act-order too).

``write_quantized_pair`` turns a float checkpoint into a quantized folder (config.json with its
``quantization_config``) and a float32 folder holding the dequantized weights, for transformers.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.quant.formats.base import QuantConfigError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i]


@dataclass
class Quantized:
    """``W[n, k] = (q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]]``."""

    q: torch.Tensor  # int64 [N, K], in the checkpoint's column order
    zeros: torch.Tensor  # int64 [N, groups]
    scales: torch.Tensor  # float16 [N, groups]
    g_idx: torch.Tensor  # int64 [K]
    bits: int

    def dequantized(self) -> torch.Tensor:
        """The exact weight, float64 (an fp16 scale times a small integer is exact)."""
        z = self.zeros[:, self.g_idx].double()
        return (self.q.double() - z) * self.scales.double()[:, self.g_idx]


def quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
             perm: torch.Tensor | None = None) -> Quantized:
    """Round-to-nearest with min/max scales per group. ``group_size`` -1: one group per row.
    ``perm`` (act-order): the columns in the order they were quantized; group ``g`` holds
    ``perm[g * G: (g + 1) * G]``."""
    n, k = weight.shape
    group = k if group_size == -1 else group_size
    order = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    maxq = (1 << bits) - 1
    groups = -(-k // group)
    q = torch.empty(n, k, dtype=torch.int64)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    scales = torch.empty(n, groups, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        w = weight[:, cols].double()
        if sym:
            s = (w.abs().amax(1) / (maxq // 2)).clamp(min=1e-4).half()
            z = torch.full((n,), 1 << (bits - 1), dtype=torch.int64)
        else:
            lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
            s = ((hi - lo) / maxq).clamp(min=1e-4).half()
            z = (-lo / s.double()).round().clamp(0, maxq).long()
        q[:, cols] = ((w / s.double()[:, None]).round() + z[:, None]).clamp(0, maxq).long()
        zeros[:, g], scales[:, g] = z, s
    return Quantized(q, zeros, scales, g_idx, bits)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _pack_last(fields: torch.Tensor, bits: int, order: tuple[int, ...] | None = None):
    """int64 ``[R, C]`` -> int32 ``[R, C * bits / 32]``; word field ``i`` (lowest bits first)
    holds column ``order[i]`` of the word's columns (default: ``i``)."""
    per_word = 32 // bits
    fields = fields.reshape(fields.shape[0], -1, per_word)
    if order is not None:
        fields = fields[..., list(order)]
    shifts = torch.arange(per_word) * bits
    return _to_int32((fields << shifts).sum(-1))


def pack_awq(qz: Quantized) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM tensors: qweight ``[K, N / 8]``, qzeros ``[K / G, N / 8]``, scales
    ``[K / G, N]`` fp16."""
    assert qz.bits == 4 and torch.equal(qz.g_idx, qz.g_idx.sort().values)
    return {"qweight": _pack_last(qz.q.T, 4, AWQ_ORDER),
            "qzeros": _pack_last(qz.zeros.T, 4, AWQ_ORDER),
            "scales": qz.scales.T.contiguous()}


def pack_gptq(qz: Quantized, v1: bool = True) -> dict[str, torch.Tensor]:
    """GPTQ tensors: qweight ``[K * bits / 32, N]`` packed along K, qzeros packed along N
    (v1: ``z - 1``, wrapped to ``bits`` bits), scales fp16, g_idx int32."""
    zeros = ((qz.zeros - 1) & ((1 << qz.bits) - 1)) if v1 else qz.zeros
    return {"qweight": _pack_last(qz.q, qz.bits).T.contiguous(),
            "qzeros": _pack_last(zeros.T, qz.bits),
            "scales": qz.scales.T.contiguous(),
            "g_idx": qz.g_idx.to(torch.int32)}


def spec_values(method: str, qweight: torch.Tensor, bits: int) -> list[list[int]]:
    """``q[n][k]`` read field by field from the words, with Python integers."""
    words = [[w & 0xFFFFFFFF for w in row] for row in qweight.tolist()]
    if method == "awq":  # [K, N / 8]; column n is in nibble AWQ_ORDER.index(n % 8)
        n_cols, k_rows = len(words[0]) * 8, len(words)
        return [[(words[k][n // 8] >> 4 * AWQ_ORDER.index(n % 8)) & 15 for k in range(k_rows)]
                for n in range(n_cols)]
    per_word = 32 // bits  # gptq: [K / per_word, N]; row k is field k % per_word
    k_rows, n_cols = len(words) * per_word, len(words[0])
    return [[(words[k // per_word][n] >> bits * (k % per_word)) & ((1 << bits) - 1)
             for k in range(k_rows)] for n in range(n_cols)]


def spec_zeros(method: str, qzeros: torch.Tensor, bits: int, v1: bool = False):
    """``z[n][g]`` read field by field, v1's stored ``z - 1`` undone."""
    words = [[w & 0xFFFFFFFF for w in row] for row in qzeros.tolist()]
    per_word = 32 // bits
    n_cols = len(words[0]) * per_word
    out = []
    for n in range(n_cols):
        field = AWQ_ORDER.index(n % 8) if method == "awq" else n % per_word
        row = [(words[g][n // per_word] >> bits * field) & ((1 << bits) - 1)
               for g in range(len(words))]
        out.append([(z + 1) % (1 << bits) if v1 else z for z in row])
    return out


# --- whole checkpoints -------------------------------------------------------------------

_MIXTRAL_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def is_decoder_linear(name: str) -> bool:
    """A decoder layer's projection: attention's, an MLP's, a shared expert's, or a routed
    expert's (Qwen's ``experts.N.gate_proj``, Mixtral's ``experts.N.w1``). Routers
    (``mlp.gate``, ``block_sparse_moe.gate``) stay float, as quantized MoE checkpoints keep
    them."""
    return ".layers." in name and (name.endswith("_proj.weight")
                                   or _MIXTRAL_EXPERT.search(name) is not None)


_FUSED_INPUTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                 "up_proj": "gate_up"}


def act_order_perm(module: str, k: int) -> torch.Tensor:
    """A random column order per input: q/k/v share one, as do gate/up (GPTQ quantizes them
    from the same inputs), so their fused layers stay quantized."""
    layer, _, proj = module.rpartition(".")
    site = f"{layer}.{_FUSED_INPUTS.get(proj, proj)}"
    return torch.randperm(k, generator=torch.Generator().manual_seed(zlib.crc32(site.encode())))


def write_quantized_pair(source: Path, quant_dir: Path, float_dir: Path,
                         quantization_config: dict, skip: tuple[str, ...] = ()) -> None:
    """Quantize every decoder-layer linear weight of ``source`` (except modules whose names
    contain an entry of ``skip``, which stay dense) as ``quantization_config`` says, writing
    the packed checkpoint to ``quant_dir`` and its dequantized float32 twin to ``float_dir``."""
    qc = quantization_config
    method = qc["quant_method"]
    bits, group_size = qc.get("bits", 4), qc.get("group_size", 128)
    sym, act_order = qc.get("sym", False), qc.get("desc_act", False)  # AWQ: asymmetric
    v1 = qc.get("checkpoint_format", "gptq") == "gptq"
    packed, dense = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if not is_decoder_linear(name) or any(s in module for s in skip):
            packed[name] = dense[name] = tensor
            continue
        perm = act_order_perm(module, tensor.shape[1]) if act_order else None
        qz = quantize(tensor, bits, group_size, sym, perm)
        parts = pack_awq(qz) if method == "awq" else pack_gptq(qz, v1)
        if method == "gptq" and not act_order and module.endswith("o_proj"):
            del parts["g_idx"]  # without desc_act, g_idx may be absent
        packed.update({f"{module}.{p}": t for p, t in parts.items()})
        dense[name] = qz.dequantized().float()
    for folder, tensors, extra in ((quant_dir, packed, {"quantization_config": qc}),
                                   (float_dir, dense, {})):
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((source / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **extra}, indent=1))


# --- engine against transformers ---------------------------------------------------------

PROMPT_LENS = (5, 19, 42)
NEW_TOKENS = 16


def linear_methods(llm) -> dict[str, str]:
    """Each linear layer's method class, by module name."""
    model = llm.engine.executor.runner.model
    return {name: type(m.method).__name__ for name, m in model.named_modules()
            if getattr(m, "method", None) is not None}


def assert_refused_before_weights(source: Path, folder: Path, quantization_config: dict,
                                  field: str) -> None:
    """``source``'s config with ``quantization_config`` over a weight file that is not one:
    starting an engine fails with a one-line error naming ``field``, so it came before any
    weight was read."""
    from tests.tiny_models import make_llm

    folder.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantConfigError) as err:
        make_llm(folder, dtype="float32")
    message = str(err.value)
    assert f"quantization_config.{field}" in message and "\n" not in message
