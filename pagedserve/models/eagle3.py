"""EAGLE-3 draft heads: one decoder layer that drafts from the target's own hidden states.

A head reads, at each position q, the target's residual stream entering three of its layers
(``aux_layer_ids``; by default 2, L / 2 and L - 3 of L), fused to one hidden state by ``fc``,
and the embedding of the token at q + 1; it predicts the token at q + 2. Its single layer
attends over its own keys and values (a one-layer KV pool addressed by the target's block
tables), its queries, keys and values projected from ``[norm(embedding), norm(hidden)]``
side by side, and its output before the final norm is the hidden state the next chained
pass reads in place of the target's. Its LM head covers a reduced draft vocabulary; ``d2t``
gives each draft id's offset to its target id.

The layout read is the public checkpoints' (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``):
``fc.weight``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}``,
``midlayer.self_attn.{q,k,v,o}_proj``, ``midlayer.mlp.{gate,up,down}_proj``, ``norm``,
``lm_head``, ``d2t`` (int64 offsets) and ``t2d`` (its inverse as a mask, not needed here),
with ``embed_tokens.weight`` where the head has its own embedding (else it shares the
target's); ``config.json`` names the architecture ``LlamaForCausalLMEagle3`` and adds
``draft_vocab_size``, optionally ``target_hidden_size``, ``norm_before_residual`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``. Weights are read from safetensors or from
the ``pytorch_model.bin`` the public heads ship (tensors only: ``weights_only``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedserve.attention.backend import AttentionBackend
from pagedserve.distributed import Part
from pagedserve.errors import ConfigError
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.embedding import VocabEmbedding
from pagedserve.models.forward_context import ForwardContext
from pagedserve.models.layer_ops import LayerOps
from pagedserve.models.layers import RMSNorm
from pagedserve.models.linear import Linear, LinearFactory
from pagedserve.models.llama import LlamaAttention, LlamaMLP, fused_target, submodule
from pagedserve.models.rotary import RotaryEmbedding
from pagedserve.quant.weights import LoadedWeight

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
_FLAG = "--speculative-config"


@dataclass(frozen=True)
class Eagle3Config:
    arch: ModelArchConfig  # the head's layer: its hidden size, heads, MLP, norms, rotary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # the target layers whose inputs ``fc`` fuses, in order
    norm_before_residual: bool  # the layer's residual is the normed hidden state (some heads)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], target: ModelArchConfig) -> Eagle3Config:
        """The head's config checked against its target: a head trained for another model is
        a one-line error here, before any weight is read."""
        archs = raw.get("architectures") or []
        if EAGLE3_ARCHITECTURE not in archs:
            raise ConfigError(f"{_FLAG}: the EAGLE-3 head's config.json names {archs!r}, not "
                              f"{EAGLE3_ARCHITECTURE}")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ConfigError(f"{_FLAG}: EAGLE-3 heads of {raw['num_hidden_layers']} layers "
                              "are not built (the public heads have one)")
        arch = ModelArchConfig.from_hf_dict({**raw, "architectures": ["LlamaForCausalLM"]})
        eagle = raw.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ConfigError(f"{_FLAG}: EAGLE-3 heads without auxiliary hidden states "
                              "(use_aux_hidden_state false) are not built")
        layers = target.num_layers
        ids = tuple(eagle.get("eagle_aux_hidden_state_layer_ids")
                    or (2, layers // 2, layers - 3))
        target_hidden = raw.get("target_hidden_size") or arch.hidden_size
        problems = []
        if arch.vocab_size != target.vocab_size:
            problems.append(f"its vocabulary is {arch.vocab_size} tokens, the target's "
                            f"{target.vocab_size}")
        if target_hidden != target.hidden_size:
            problems.append(f"it reads hidden states of {target_hidden}, the target's are "
                            f"{target.hidden_size}")
        if len(ids) != 3 or not all(0 <= i < layers for i in ids):
            problems.append(f"its auxiliary layers {list(ids)} are not three of the target's "
                            f"{layers}")
        if problems:
            raise ConfigError(f"{_FLAG}: the EAGLE-3 head does not fit the target: "
                              f"{'; '.join(problems)}")
        return cls(arch, int(raw.get("draft_vocab_size") or arch.vocab_size), target_hidden,
                   ids, bool(raw.get("norm_before_residual", False)))

    @classmethod
    def from_folder(cls, folder: Path, target: ModelArchConfig) -> Eagle3Config:
        try:
            raw = json.loads((folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{_FLAG}: cannot read the EAGLE-3 head's config.json in "
                              f"{folder}: {exc}") from None
        return cls.from_hf_dict(raw, target)


def is_eagle3_folder(folder: Path) -> bool:
    """Whether a checkpoint folder holds an EAGLE-3 head (its config names the architecture)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return EAGLE3_ARCHITECTURE in (raw.get("architectures") or [])


def iter_head_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The head's tensors: its safetensors files, else the ``pytorch_model.bin`` the public
    heads ship (read as tensors only)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if files:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    path = folder / "pytorch_model.bin"
    if not path.is_file():
        raise ConfigError(f"{_FLAG}: {folder} has neither *.safetensors nor pytorch_model.bin")
    yield from torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, rotary: RotaryEmbedding, backend: AttentionBackend,
                 ops: type[LayerOps], linears: LinearFactory) -> None:
        super().__init__()
        a = cfg.arch
        self.self_attn = LlamaAttention(a, rotary, backend, ops, linears,
                                        input_size=2 * a.hidden_size)
        self.mlp = LlamaMLP(a, ops, linears)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, ops)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, ops)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, positions, embeds: torch.Tensor, hidden: torch.Tensor, kv_cache,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(positions, x, kv_cache, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, ctx), residual


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, backend: AttentionBackend, max_positions: int,
                 ops: type[LayerOps], linears: LinearFactory, own_embedding: bool) -> None:
        super().__init__()
        a = cfg.arch
        self.config = cfg
        rotary = RotaryEmbedding(a.head_dim, max_positions, a.rope_theta, a.rope_scaling, ops)
        # Without its own table the head reads the target's (``share_embedding``).
        self.embed_tokens = (VocabEmbedding(a.vocab_size, a.hidden_size, linears.dtype,
                                            linears.device) if own_embedding else None)
        self.fc = linears.column(3 * cfg.target_hidden_size, [Part.whole(a.hidden_size)])
        self.midlayer = Eagle3Layer(cfg, rotary, backend, ops, linears)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, ops)
        self.lm_head = linears.column(a.hidden_size, [Part.whole(cfg.draft_vocab_size)],
                                      quantize_at_load=False)
        # The target id of each draft id (arange + d2t), for greedy drafts and for scattering
        # the draft's distribution over the target's vocabulary.
        self.register_buffer("draft_to_target", torch.arange(
            cfg.draft_vocab_size, device=linears.device), persistent=False)
        self._shared_embedding: VocabEmbedding | None = None

    def share_embedding(self, table: VocabEmbedding) -> None:
        if self.embed_tokens is None:
            self._shared_embedding = table

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's auxiliary hidden states ``[T, 3 * H_target]`` to the head's input."""
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, prenorm)``: the states the LM head reads, and the ones the next chained
        pass takes as its ``hidden``."""
        table = self.embed_tokens or self._shared_embedding
        x, residual = self.midlayer(positions, table(input_ids), hidden, kv_cache, ctx)
        return self.norm(x, residual)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (``draft_to_target`` maps their ids)."""
        return self.lm_head(normed)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the public layout, with its shape (random heads are made from it)."""
        c, a = self.config, self.config.arch
        h, q, kv = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        shapes = {"fc.weight": (h, 3 * c.target_hidden_size), "norm.weight": (h,),
                  "lm_head.weight": (c.draft_vocab_size, h), "d2t": (c.draft_vocab_size,)}
        if self.embed_tokens is not None:
            shapes["embed_tokens.weight"] = (a.vocab_size, h)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            shapes[f"midlayer.{name}.weight"] = (h,)
        shapes.update({"midlayer.self_attn.q_proj.weight": (q, 2 * h),
                       "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
                       "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
                       "midlayer.self_attn.o_proj.weight": (h, q),
                       "midlayer.mlp.gate_proj.weight": (a.intermediate_size, h),
                       "midlayer.mlp.up_proj.weight": (a.intermediate_size, h),
                       "midlayer.mlp.down_proj.weight": (h, a.intermediate_size)})
        return shapes

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        """The public layout's tensors into their modules; a missing or unknown tensor, or a
        draft-to-target map pointing outside the target's vocabulary, raises."""
        params = dict(self.named_parameters())
        expected = set(self.checkpoint_shapes())
        seen: set[str] = set()
        for name, weight in weights:
            if name == "t2d":
                continue
            if name not in expected:
                raise ConfigError(f"{_FLAG}: the EAGLE-3 head's tensor {name!r} is not in its "
                                  "layout (a head of another kind?)")
            seen.add(name)
            if name == "d2t":
                self._load_draft_map(weight)
                continue
            target, shard = fused_target(name)
            owner_name, _, kind = target.rpartition(".")
            owner = submodule(self, owner_name)
            if isinstance(owner, Linear):
                owner.load_shard(shard or 0, weight)
            elif isinstance(owner, VocabEmbedding):
                owner.load(weight)
            else:
                params[target].copy_(weight)
        missing = sorted(expected - seen - {"d2t"})
        if missing:
            raise ConfigError(f"{_FLAG}: the EAGLE-3 head lacks {len(missing)} tensors, e.g. "
                              f"{missing[0]}")

    def _load_draft_map(self, d2t: torch.Tensor) -> None:
        ids = torch.arange(self.config.draft_vocab_size) + d2t.to("cpu", torch.int64)
        if ids.min() < 0 or ids.max() >= self.config.arch.vocab_size:
            raise ConfigError(f"{_FLAG}: the EAGLE-3 head's d2t maps draft ids outside the "
                              f"target's vocabulary of {self.config.arch.vocab_size}")
        self.draft_to_target.copy_(ids)


def random_head_weights(head: Eagle3Head, seed: int, dtype: torch.dtype, device: torch.device,
                        skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """A random head of ``head``'s layout but the tensors in ``skip``, as ``load_weights``
    reads it: norms at 1, matrices small normal values, and a draft vocabulary of random target
    ids in ascending order (as the public heads' most frequent tokens are, by id)."""
    cfg = head.config
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in head.checkpoint_shapes().items():
        if name in skip:
            continue
        if name == "d2t":
            chosen = torch.randperm(cfg.arch.vocab_size, generator=generator, device=device)
            ids = chosen[:cfg.draft_vocab_size].sort().values
            yield name, ids - torch.arange(cfg.draft_vocab_size, device=device)
        elif "norm" in name:
            yield name, torch.ones(shape, dtype=dtype, device=device)
        else:
            yield name, torch.empty(shape, dtype=dtype, device=device).normal_(
                0.0, 0.02, generator=generator)
