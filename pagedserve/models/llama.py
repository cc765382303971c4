"""The Llama family: Llama 2/3 (and SmolLM2), Mistral, and Qwen2 (q/k/v biases).

Parameter names follow Hugging Face checkpoints, except that q/k/v and gate/up projections are
fused into one matmul each; ``load_weights`` stacks the checkpoint's shards into them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.layer_ops import LayerOps
from pagedserve.models.layers import PagedAttention, RMSNorm, SiluAndMul
from pagedserve.models.rotary import RotaryEmbedding

# checkpoint name fragment -> (fused parameter fragment, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = PagedAttention(backend)

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.shard_sizes(), dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops: type[LayerOps]) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul(ops)

    def shard_sizes(self) -> list[int]:
        return [self.intermediate_size, self.intermediate_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding,
                 backend: AttentionBackend, ops: type[LayerOps]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, backend)
        self.mlp = LlamaMLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 ops: type[LayerOps]) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                 ops)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, rotary, backend, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 ops: type[LayerOps]) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, backend, max_positions, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` for a packed batch of tokens."""
        return self.model(input_ids, positions, kv_caches, meta)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in, stacking q/k/v and gate/up shards into fused weights.
        Raises if a parameter is left unloaded, so a partial checkpoint cannot run silently."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, shard = _fused_target(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
            param = params[target]
            if shard is None:
                param.copy_(tensor)
            else:
                owner = self.get_submodule(target.rsplit(".", 2)[0])
                sizes = owner.shard_sizes()
                offset = sum(sizes[:shard])
                param[offset:offset + sizes[shard]].copy_(tensor)
            loaded.add(f"{target}#{shard}")
        self._check_complete(params, loaded)

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        expected = set()
        for name in params:
            if "qkv_proj" in name:
                expected |= {f"{name}#{i}" for i in range(3)}
            elif "gate_up_proj" in name:
                expected |= {f"{name}#{i}" for i in range(2)}
            else:
                expected.add(f"{name}#None")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0]}")


def _fused_target(name: str) -> tuple[str, int | None]:
    for fragment, (fused, shard) in _STACKED.items():
        if f".{fragment}." in name:
            return name.replace(fragment, fused), shard
    return name, None
