"""Random EAGLE-3 heads in the public checkpoints' layout for the tiny targets, and EAGLE-3
drafting computed from its definition in float64 (transformers' target for the hidden states,
dense causal attention for the head), the reference the engine's drafts are compared with."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# The tiny targets have two layers: the head reads the inputs of layers 0, 1 and 1.
AUX_IDS = [0, 1, 1]


def head_config(target_folder: Path, draft_vocab_size: int, **overrides) -> dict:
    target = json.loads((target_folder / "config.json").read_text())
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "vocab_size", "rope_theta", "rope_scaling",
            "rope_parameters", "head_dim")
    cfg = {k: target[k] for k in keep if k in target}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
               num_hidden_layers=1, intermediate_size=96, draft_vocab_size=draft_vocab_size,
               eagle_config={"eagle_aux_hidden_state_layer_ids": AUX_IDS,
                             "use_aux_hidden_state": True})
    cfg.update(overrides)
    return cfg


def head_tensors(cfg: dict, seed: int, own_embedding: bool = False) -> dict[str, torch.Tensor]:
    """The public layout's tensors (``t2d`` included), float32, matrices of std 0.08 so the
    head's choices are decisive; the draft vocabulary a random ascending subset."""
    g = torch.Generator().manual_seed(seed)
    h, i, v, vd = (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"],
                   cfg["draft_vocab_size"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads

    def matrix(*shape):
        return torch.randn(*shape, generator=g) * 0.08

    ids = torch.randperm(v, generator=g)[:vd].sort().values if vd < v else torch.arange(v)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    w = {"fc.weight": matrix(h, 3 * h), "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
         "lm_head.weight": matrix(vd, h), "d2t": ids - torch.arange(vd), "t2d": t2d,
         "midlayer.self_attn.q_proj.weight": matrix(heads * d, 2 * h),
         "midlayer.self_attn.k_proj.weight": matrix(kv_heads * d, 2 * h),
         "midlayer.self_attn.v_proj.weight": matrix(kv_heads * d, 2 * h),
         "midlayer.self_attn.o_proj.weight": matrix(h, heads * d),
         "midlayer.mlp.gate_proj.weight": matrix(i, h),
         "midlayer.mlp.up_proj.weight": matrix(i, h),
         "midlayer.mlp.down_proj.weight": matrix(h, i)}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"midlayer.{name}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    if own_embedding:
        w["embed_tokens.weight"] = matrix(v, h)
    return w


def write_eagle3_head(folder: Path, target_folder: Path, *, seed: int = 0,
                      draft_vocab_size: int = 200, fmt: str = "bin",
                      own_embedding: bool = False, tensors: dict | None = None,
                      **overrides) -> Path:
    """A head folder: ``config.json`` and ``pytorch_model.bin`` (as the public heads ship) or
    ``model.safetensors``."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head_config(target_folder, draft_vocab_size, **overrides)
    (folder / "config.json").write_text(json.dumps(cfg))
    w = tensors if tensors is not None else head_tensors(cfg, seed, own_embedding)
    if fmt == "bin":
        torch.save(w, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(w, str(folder / "model.safetensors"))
    return folder


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", weights_only=True)
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


class ReferenceEagle3:
    """EAGLE-3 drafting in float64: at position q the head reads the target's residual
    stream entering the auxiliary layers (transformers' ``hidden_states``), fused by ``fc``,
    and the embedding of the token at q + 1; a chained pass reads the previous pass's hidden
    state before the final norm. Attention is dense and causal over every key the head wrote,
    in position order."""

    def __init__(self, head_folder: Path, target_folder: Path) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.cfg = json.loads((head_folder / "config.json").read_text())
        self.w = {k: v.double() if v.is_floating_point() else v
                  for k, v in read_tensors(head_folder).items()}
        self.target = AutoModelForCausalLM.from_pretrained(target_folder,
                                                           dtype=torch.float64).eval()
        c = self.cfg
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.d = c.get("head_dim") or c["hidden_size"] // self.heads
        self.eps = c["rms_norm_eps"]
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**{
            k: v for k, v in c.items()
            if k not in ("architectures", "draft_vocab_size", "eagle_config")}))
        self.aux_ids = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        self.to_target = torch.arange(c["draft_vocab_size"]) + self.w["d2t"]
        self.embed = self.w.get("embed_tokens.weight",
                                self.target.model.embed_tokens.weight.detach())

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def _layer(self, embeds, hidden, positions, cache: dict):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        w, p, n = self.w, "midlayer.", len(positions)
        x = torch.cat([self._norm(embeds, p + "input_layernorm.weight"),
                       self._norm(hidden, p + "hidden_norm.weight")], dim=-1)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, self.heads, self.d)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, self.kv_heads, self.d)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, self.kv_heads, self.d)
        cos, sin = self.rotary(x[None], positions[None])
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                    cos.double(), sin.double())
        cache["k"] = torch.cat([cache.get("k", k[:, :, :0]), k], dim=2)
        cache["v"] = torch.cat([cache.get("v", k[:, :, :0]), v.transpose(0, 1)[None]], dim=2)
        cache["pos"] = torch.cat([cache.get("pos", positions[:0]), positions])
        group = self.heads // self.kv_heads
        keys = cache["k"].repeat_interleave(group, dim=1)
        values = cache["v"].repeat_interleave(group, dim=1)
        scores = q @ keys.transpose(-1, -2) / self.d ** 0.5
        scores = scores.masked_fill(cache["pos"][None, :] > positions[:, None], float("-inf"))
        out = (scores.softmax(-1) @ values)[0].transpose(0, 1).reshape(n, -1)
        residual = hidden + out @ w[p + "self_attn.o_proj.weight"].T
        h = self._norm(residual, p + "post_attention_layernorm.weight")
        mlp = (torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
               * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        prenorm = residual + mlp
        return self._norm(prenorm, "norm.weight"), prenorm

    @torch.no_grad()
    def pass_logits(self, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
        """Draft-vocabulary logits of each pass of a step whose first input is ``tokens[-1]``
        (at position n = len(tokens) - 1), the later passes fed ``drafts`` (target ids)."""
        n = len(tokens) - 1
        hs = self.target(torch.tensor([tokens[:n]]), output_hidden_states=True).hidden_states
        fused = torch.cat([hs[i][0] for i in self.aux_ids], dim=-1) @ self.w["fc.weight"].T
        cache: dict = {}
        normed, prenorm = self._layer(self.embed[tokens[1:]], fused, torch.arange(n), cache)
        head = self.w["lm_head.weight"]
        out, hidden = [normed[-1] @ head.T], prenorm[-1:]
        for j, token in enumerate(drafts):
            normed, hidden = self._layer(self.embed[[token]], hidden, torch.tensor([n + j]),
                                         cache)
            out.append(normed[0] @ head.T)
        return out
