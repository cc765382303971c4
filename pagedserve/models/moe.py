"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE, in place of a
dense MLP.

A router (``gate``, hidden -> experts, no bias) scores every expert; the softmax over them is
taken in float32, the ``top_k`` best kept and, where the config says (Mixtral always, the
Qwen models with ``norm_topk_prob``), renormalised to sum to 1. The experts are SwiGLU MLPs
whose weights are stacked at load into ``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]``, the
layout the platform's ``LayerOps.fused_moe`` reads, or, from a quantized checkpoint (or
``--quantization fp8``), kept quantized: FP8 and grouped integer experts read as they are by
the platform's ``LayerOps.fused_moe_fp8`` and ``fused_moe_int`` where it has them
(``models/kernel_experts.py``), others dequantized per step for the experts the step routes
tokens to (``models/quantized_experts.py``).
Qwen2-MoE adds a shared expert, a dense SwiGLU MLP every token goes through, scaled by
``sigmoid(shared_expert_gate(x))`` (a hidden -> 1 projection) and added to the routed
experts' sum.

Under tensor parallelism every rank holds the whole router (and the shared expert's gate) and
a slice of each expert's intermediate dimension (as the dense MLP is cut, the shared expert
too), so the block's output is a partial sum, all-reduced once as the dense MLP's down
projection is: the shared expert's down projection leaves its partial output unreduced, and
its per-token scale, the same on every rank, distributes over the sum.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from pagedserve.distributed import Part
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.forward_context import ForwardContext
from pagedserve.models.fp8_experts import Fp8Experts
from pagedserve.models.int_experts import IntExperts
from pagedserve.models.kernel_experts import KernelExperts
from pagedserve.models.layer_ops import LayerOps
from pagedserve.models.linear import LinearFactory
from pagedserve.models.quantized_experts import QuantizedExperts
from pagedserve.quant.weights import LoadedWeight, take_columns, take_rows

# ``model.layers.3.mlp.experts.7.up_proj.weight`` (Qwen3-MoE) or, Mixtral's names,
# ``model.layers.3.block_sparse_moe.experts.7.w3.weight``.
_EXPERT_WEIGHT = re.compile(
    r"^(?P<experts>.+\.(?:mlp|block_sparse_moe)\.experts)\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
         "w2": "down"}


class ExpertWeight(NamedTuple):
    """One expert's projection as a checkpoint names it."""
    module: str  # the ``FusedExperts`` module's name in our model
    expert: int
    proj: str  # gate | up | down


def expert_weight(name: str) -> ExpertWeight | None:
    """The expert projection ``name`` is, or None for any other tensor."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    module = match["experts"].replace(".block_sparse_moe.", ".mlp.")
    return ExpertWeight(module, int(match["expert"]), _PROJ[match["proj"]])


def moe_module_name(name: str) -> str:
    """A checkpoint's name under ours: Mixtral's ``block_sparse_moe`` is our ``mlp``."""
    return name.replace(".block_sparse_moe.", ".mlp.")


class FusedExperts(nn.Module):
    """Every expert's SwiGLU weights of one layer, this rank's ``part`` of each, held as the
    checkpoint stores them. Float experts are stacked into ``w13`` ``[E, 2I, H]`` (``w13[e]``:
    expert ``e``'s gate rows then its up rows) and ``w2`` ``[E, H, I]``, the layout
    ``LayerOps.fused_moe`` reads; quantized ones into ``quantized``
    (``models/quantized_experts.py``), dequantized per step, or, once the last has arrived,
    turned into the first of the kernel layouts ``reads`` (those the platform's ops have an
    entry for: ``kernel_layouts``) that takes them. The first weight to arrive decides which,
    so a quantized checkpoint never allocates the 16-bit stacks. ``quantizer``
    (``--quantization fp8`` or a dummy load's form) quantizes float experts as it does the
    dense layers. Each checkpoint tensor is cut and put in its place as it arrives; ``loaded``
    once all ``3 * E`` have."""

    def __init__(self, num_experts: int, hidden: int, part: Part, dtype: torch.dtype,
                 device: torch.device,
                 quantizer: Callable[[torch.Tensor], LoadedWeight] | None = None,
                 reads: tuple[type[KernelExperts], ...] = ()) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.part = part
        self.hidden = hidden
        self.dtype = dtype
        self.device = device
        self.quantizer = quantizer
        self.reads = reads
        self.register_parameter("w13", None)
        self.register_parameter("w2", None)
        self.quantized: QuantizedExperts | KernelExperts | None = None
        self._missing = {(e, p) for e in range(num_experts) for p in ("gate", "up", "down")}

    @property
    def loaded(self) -> bool:
        return not self._missing

    @property
    def syncs_with_host(self) -> bool:
        """Whether a step reads device values on the host (quantized experts dequantized per
        step do: which experts)."""
        return self.quantized is not None and self.quantized.syncs_with_host

    def load(self, expert: int, proj: str, weight: LoadedWeight) -> None:
        if expert >= self.num_experts:
            raise ValueError(f"expert {expert} is past the config's {self.num_experts}")
        full = (self.part.full, self.hidden) if proj != "down" else (self.hidden, self.part.full)
        if tuple(weight.shape) != full:
            raise ValueError(f"expert {expert}'s {proj} projection has shape "
                             f"{tuple(weight.shape)}, expected {full}")
        weight = self._rank_part(proj, weight)
        if self.quantizer is not None and isinstance(weight, torch.Tensor):
            weight = self.quantizer(weight)
        if isinstance(weight, torch.Tensor):
            self._load_float(expert, proj, weight)
        else:
            self._load_quantized(expert, proj, weight)
        self._missing.discard((expert, proj))
        if self.loaded and isinstance(self.quantized, QuantizedExperts):
            layout = next((c for c in self.reads if c.takes(self.quantized)), None)
            if layout is not None:
                self.quantized = layout(self.quantized)  # the stacks go

    def forward(self, ops: type[LayerOps], hidden: torch.Tensor,
                routed: RoutedExperts) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(ops, hidden, routed.ids, routed.weights)
        return ops.fused_moe(hidden, self.w13, self.w2, routed.ids, routed.weights)

    def _rank_part(self, proj: str, weight: LoadedWeight) -> LoadedWeight:
        """Gate and up: this rank's rows; down: its columns (a ``ConfigError`` where the cut
        would split a quantization group or FP8 block, as for the dense layers)."""
        part = self.part
        if part.is_whole:
            return weight
        cut = take_columns if proj == "down" else take_rows
        return cut(weight, part.start, part.size)

    def _load_float(self, expert: int, proj: str, weight: torch.Tensor) -> None:
        self._refuse_mixed(expert, proj, weight, self.quantized is not None)
        if self.w13 is None:
            size = self.part.size
            self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * size, self.hidden,
                                                dtype=self.dtype, device=self.device),
                                    requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(self.num_experts, self.hidden, size,
                                               dtype=self.dtype, device=self.device),
                                   requires_grad=False)
        if proj == "down":
            self.w2[expert].copy_(weight)
        else:
            offset = 0 if proj == "gate" else self.part.size
            self.w13[expert, offset:offset + self.part.size].copy_(weight)

    def _load_quantized(self, expert: int, proj: str, weight: LoadedWeight) -> None:
        self._refuse_mixed(expert, proj, weight, self.w13 is not None)
        if self.quantized is None:
            self.quantized = QuantizedExperts(self.num_experts, self.device)
        self.quantized.put(expert, proj, weight)

    @staticmethod
    def _refuse_mixed(expert: int, proj: str, weight: LoadedWeight, other_kind: bool) -> None:
        if other_kind:
            kind = "float" if isinstance(weight, torch.Tensor) else "quantized"
            raise ValueError(f"expert {expert}'s {proj} projection is {kind}, unlike others "
                             "of its layer: a layer's experts load all float or all quantized")

    def extra_repr(self) -> str:
        if self.w13 is None:
            return f"experts={self.num_experts}"
        return f"w13={tuple(self.w13.shape)}, w2={tuple(self.w2.shape)}"


def kernel_layouts(ops: type[LayerOps]) -> tuple[type[KernelExperts], ...]:
    """The quantized expert layouts whose entry points the platform's ops have."""
    return tuple(c for c in (Fp8Experts, IntExperts) if c.reads(ops))


class RoutedExperts(NamedTuple):
    weights: torch.Tensor  # float32 [T, K]
    ids: torch.Tensor  # int64 [T, K]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> RoutedExperts:
    """The ``top_k`` experts of each token and their weights: a softmax in float32 over all
    experts, then the top-k of it, renormalised to sum to 1 if asked. The weights stay in
    float32 (as transformers' Mixtral keeps them; its Qwen3-MoE rounds them to the activation
    dtype first, which differs from this only in bfloat16/float16 rounding)."""
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return RoutedExperts(weights, ids)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops: type[LayerOps], linears: LinearFactory,
                 shared_expert: nn.Module | None = None) -> None:
        """``shared_expert``: Qwen2-MoE's dense MLP (the model's ``LlamaMLP``, called as
        ``mlp(x, ctx)``, its down projection left unreduced), added to every token's routed
        sum as scaled by ``shared_expert_gate``."""
        super().__init__()
        # Replicated on every rank, and left in the checkpoint's precision.
        self.gate = linears.column(cfg.hidden_size, [Part.whole(cfg.num_experts)],
                                   quantize_at_load=False)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size,
                                    linears.tp.even_part(cfg.moe_intermediate_size),
                                    linears.dtype, linears.device, linears.quantizer,
                                    reads=kernel_layouts(ops))
        self.shared_expert = shared_expert
        # Replicated, as the router is: each token's scale must be the same on every rank.
        self.shared_expert_gate = (linears.column(cfg.hidden_size, [Part.whole(1)],
                                                  quantize_at_load=False)
                                   if shared_expert is not None else None)
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.ops = ops
        self.tp = linears.tp

    @property
    def input_linear(self) -> None:
        """The experts read plain activations: the norm before hands over no quantized ones."""
        return None

    def expert_bytes(self) -> int:
        """Bytes of this rank's experts, however they are held."""
        return sum(p.numel() * p.element_size() for p in self.experts.parameters())

    def expected_experts(self, tokens: int) -> float:
        """How many experts ``tokens`` tokens are routed to on average if each picks its
        ``top_k`` uniformly: each expert is missed by a token with probability
        ``(E - top_k) / E``."""
        experts = self.experts.num_experts
        return experts * (1 - ((experts - self.top_k) / experts) ** tokens)

    @property
    def syncs_with_host(self) -> bool:
        """Whether a step through this block reads device values on the host, which a captured
        graph cannot: the platform's ``fused_moe`` may (``fused_moe_in_graphs`` False), and
        quantized experts dequantized per step do (which experts); experts read as they are
        (``KernelExperts``) do not."""
        return not self.ops.fused_moe_in_graphs or self.experts.syncs_with_host

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        routed = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(self.ops, x, routed)
        if self.shared_expert is not None:
            out = out + self.shared_expert_gate(x).sigmoid() * self.shared_expert(x, ctx)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


def syncs_with_host(model: nn.Module) -> bool:
    """Whether any mixture-of-experts block of ``model`` syncs with the host in a step (so its
    steps run eagerly, never from captured graphs)."""
    return any(m.syncs_with_host for m in model.modules() if isinstance(m, SparseMoeBlock))
