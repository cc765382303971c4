"""Gemma 2 and Gemma 3 (text): Llama's attention and fused projections, with Gemma's
differences, as transformers' ``modeling_gemma2.py`` and ``modeling_gemma3.py`` compute them:

- every RMSNorm scales by one plus its weight, in float32 (``GemmaRMSNorm``), and each
  sublayer's output is normalised before it joins the residual stream (``post_attention_``
  and ``post_feedforward_layernorm``), its input after (``input_`` and
  ``pre_feedforward_layernorm``);
- the MLP is GeGLU (gelu in its tanh approximation);
- embeddings are scaled by ``sqrt(hidden_size)`` rounded to the model's dtype (in bfloat16
  Gemma 2 9B's 59.87 is 59.75, Gemma 3 1B's 33.94 is 34.0);
- the softmax scale is ``query_pre_attn_scalar ** -0.5``; local layers attend within a sliding
  window (``ModelArchConfig.sliding_layers``), global ones over the whole context;
- Gemma 2 caps attention scores and logits (``softcap * tanh(x / softcap)``); Gemma 3 has
  Qwen3-style q/k norms (Gemma's kind) and rotates its local layers with their own base
  (``rope_local_theta``), unscaled, its global ones with ``rope_theta`` and its scaling.

The LM head is the embedding table (tied), as in every released Gemma 2 and 3. Loading,
tensor parallelism and LoRA are Llama's (``LlamaForCausalLM``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from pagedserve.attention.backend import AttentionBackend
from pagedserve.distributed import PipelineStage
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.forward_context import ForwardContext
from pagedserve.models.layer_ops import LayerOps
from pagedserve.models.layers import GeluAndMul, GemmaRMSNorm
from pagedserve.models.linear import LinearFactory
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from pagedserve.models.rotary import RotaryEmbedding
from pagedserve.quant.weights import LoadedWeight


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding,
                 backend: AttentionBackend, ops: type[LayerOps], linears: LinearFactory,
                 window: int | None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, backend, ops, linears, window=window,
                                        norm=GemmaRMSNorm)
        self.mlp = LlamaMLP(cfg, ops, linears, act=GeluAndMul())
        norm = (cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.input_layernorm = GemmaRMSNorm(*norm)
        self.post_attention_layernorm = GemmaRMSNorm(*norm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(*norm)
        self.post_feedforward_layernorm = GemmaRMSNorm(*norm)

    def forward(self, positions, hidden, residual, kv_cache, ctx: ForwardContext):
        """``LlamaDecoderLayer``'s contract: the residual stream is ``hidden + residual``,
        each added into the next norm (transformers adds them at the end of each sublayer,
        in the model's dtype, as the norms do here)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, ctx))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden, ctx)), residual


class GemmaModel(LlamaModel):
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 ops: type[LayerOps], linears: LinearFactory,
                 stage: PipelineStage = PipelineStage()) -> None:
        super().__init__(cfg, backend, max_positions, ops, linears, stage)
        # As transformers scales: by the factor rounded to the dtype, the product rounded.
        self.normalizer = torch.tensor(cfg.hidden_size ** 0.5, dtype=linears.dtype).item()

    @staticmethod
    def layer_factory(cfg: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                      ops: type[LayerOps], linears: LinearFactory) -> Callable[[int], nn.Module]:
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                 ops)
        local = rotary if cfg.rope_local_theta is None else RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_local_theta, None, ops)
        sliding = cfg.sliding_layers or ()
        return lambda i: GemmaDecoderLayer(cfg, local if i in sliding else rotary, backend, ops,
                                           linears, cfg.layer_window(i))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.normalizer


class GemmaForCausalLM(LlamaForCausalLM):
    model_class = GemmaModel

    @staticmethod
    def canonical_weights(weights: Iterable[tuple[str, LoadedWeight]]
                          ) -> Iterator[tuple[str, LoadedWeight]]:
        """``LlamaForCausalLM.canonical_weights``, and a ``Gemma3ForConditionalGeneration``
        checkpoint's language model under this class's names: ``language_model.model.X`` (as
        published) or ``model.language_model.X`` (as transformers 5 saves it) is
        ``model.X``, its ``language_model.lm_head`` the (tied) ``lm_head``; the vision tower
        and the projector are skipped, never held (``config.LANGUAGE_MODELS``)."""
        def renamed():
            for name, weight in weights:
                if name.startswith(_VISION_PREFIXES):
                    continue
                for prefix, to in _LANGUAGE_MODEL_PREFIXES:
                    if name.startswith(prefix):
                        name = to + name.removeprefix(prefix)
                        break
                yield name, weight

        return LlamaForCausalLM.canonical_weights(renamed())


_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head."),
                            ("model.language_model.", "model."))
