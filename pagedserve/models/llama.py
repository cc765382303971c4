"""The Llama family: Llama 2/3 (and SmolLM2), Mistral, Qwen2 (q/k/v biases) and Qwen3 dense
(an RMSNorm over each head's q and k before the rotation), Phi-3 (fused checkpoint tensors,
partial rotary), Granite (scaled embeddings, residual branches, softmax and logits), and the
mixture-of-experts models on the same attention: Mixtral (Mistral's), Qwen2-MoE (Qwen2's, and
a shared expert in each sparse block) and Qwen3-MoE (Qwen3's), whose layers each have a dense
MLP or a sparse MoE block (``models/moe.py``) as the config says.

Module names follow Hugging Face checkpoints, except that q/k/v and gate/up projections are
fused into one matmul each; ``load_weights`` hands the checkpoint's shards to them (a Phi-3
checkpoint's fused tensors cut back into their shards first, so each tensor-parallel rank
takes its slice of q, of k and of v). Linear
layers come from a ``LinearFactory``, so their weights may be dense or quantized.

Under pipeline parallelism a model is one stage's (``distributed.PipelineStage``): its decoder
layers alone, under their checkpoint numbers (the others' places hold empty ``nn.Identity``
modules), the embedding on the first stage, the final norm and the heads on the last (a tied
LM head reads the checkpoint's embedding table there); ``load_weights`` skips the tensors of
other stages.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from pagedserve.attention.backend import AttentionBackend
from pagedserve.distributed import Intermediate, Part, PipelineStage, split_heads
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.embedding import VocabEmbedding
from pagedserve.models.forward_context import ForwardContext
from pagedserve.models.layer_ops import LayerOps
from pagedserve.models.layers import PagedAttention, RMSNorm, SiluAndMul
from pagedserve.models.linear import Linear, LinearFactory
from pagedserve.models.moe import FusedExperts, SparseMoeBlock, expert_weight, moe_module_name
from pagedserve.models.rotary import RotaryEmbedding
from pagedserve.quant.linear_method import QuantizedActivation
from pagedserve.quant.weights import LoadedWeight, take_rows

# checkpoint name fragment -> (fused parameter fragment, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding,
                 backend: AttentionBackend, ops: type[LayerOps], linears: LinearFactory,
                 input_size: int | None = None, window: int | None = None,
                 norm: type[RMSNorm] = RMSNorm) -> None:
        """``input_size``: the width q/k/v are projected from, the hidden size unless given
        (an EAGLE-3 head's layer reads a token's embedding and a hidden state side by
        side). ``window``: the layer's sliding window (``ModelArchConfig.layer_window``);
        ``norm``: the q/k norms' kind (Gemma 3's scale by one plus their weight)."""
        super().__init__()
        heads = split_heads(cfg.num_heads, cfg.num_kv_heads, linears.tp)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            heads.num_heads, heads.num_kv_heads, cfg.head_dim)
        self.q_size = heads.num_heads * cfg.head_dim
        q, kv = (Part(p.full * cfg.head_dim, p.start * cfg.head_dim, p.size * cfg.head_dim)
                 for p in (heads.q, heads.kv))
        self.qkv_proj = linears.column(input_size or cfg.hidden_size, [q, kv, kv],
                                       bias=cfg.attention_bias)
        self.o_proj = linears.row(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        # Qwen3: one weight of head_dim each, shared by all heads, so every rank holds it whole.
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(backend, window, cfg.attn_logit_softcap)

    def forward(self, positions, hidden: torch.Tensor | QuantizedActivation, kv_cache,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden, ctx.lora_slots).split(self.qkv_proj.out_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = _norm_heads(self.q_norm, q), _norm_heads(self.k_norm, k)
        q, k = self.rotary(positions, q, k, ctx.long_rope)
        out = self.attn(q, k, v, kv_cache, ctx)
        return self.o_proj(out.reshape(-1, self.q_size), ctx.lora_slots)


def _norm_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]`` with each head's vector normalised: one norm over ``[T * H, D]``
    rows, a contiguous copy (the fused kernels read rows; ``x`` is a strided view of qkv)."""
    return norm(x.reshape(-1, x.shape[-1])).view(x.shape)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops: type[LayerOps], linears: LinearFactory,
                 intermediate_size: int | None = None, reduce: bool = True,
                 act: nn.Module | None = None) -> None:
        """``intermediate_size``: the config's unless given (Qwen2-MoE's shared expert);
        ``reduce=False``: under tensor parallelism the output is this rank's partial sum,
        which the caller all-reduces. ``act``: the gated activation, SwiGLU unless given
        (Gemma's GeGLU)."""
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        part = linears.tp.even_part(inter)
        self.gate_up_proj = linears.column(cfg.hidden_size, [part, part])
        self.down_proj = linears.row(inter, cfg.hidden_size, reduce=reduce)
        self.act = act or SiluAndMul(ops)

    @property
    def input_linear(self) -> Linear:
        """The projection the norm before hands its output to (maybe quantized)."""
        return self.gate_up_proj

    def forward(self, x: torch.Tensor | QuantizedActivation, ctx: ForwardContext) -> torch.Tensor:
        slots = ctx.lora_slots
        return self.down_proj(self.act(self.gate_up_proj(x, slots), into=self.down_proj), slots)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding,
                 backend: AttentionBackend, ops: type[LayerOps],
                 linears: LinearFactory, moe: bool = False, window: int | None = None) -> None:
        """``moe``: the layer's MLP is the sparse mixture-of-experts block; ``window``: its
        attention's sliding window."""
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, backend, ops, linears, window=window)
        self.mlp = _sparse_block(cfg, ops, linears) if moe else LlamaMLP(cfg, ops, linears)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        # Granite scales each branch before the norm after it adds it to the residual.
        self.branch_scale = cfg.residual_multiplier

    def forward(self, positions, hidden, residual, kv_cache, ctx: ForwardContext):
        # Each norm may hand the projection after it quantized activations (FP8 W8A8).
        qkv_proj = self.self_attn.qkv_proj
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, into=qkv_proj)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, into=qkv_proj)
        hidden = self._scaled(self.self_attn(positions, hidden, kv_cache, ctx))
        hidden, residual = self.post_attention_layernorm(hidden, residual,
                                                         into=self.mlp.input_linear)
        return self._scaled(self.mlp(hidden, ctx)), residual

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.branch_scale == 1.0 else branch * self.branch_scale


def _sparse_block(cfg: ModelArchConfig, ops: type[LayerOps],
                  linears: LinearFactory) -> SparseMoeBlock:
    """A layer's MoE block, with Qwen2-MoE's shared expert: a dense MLP whose partial output
    the block adds to its experts' before its one all-reduce."""
    shared = (LlamaMLP(cfg, ops, linears, cfg.shared_expert_intermediate_size, reduce=False)
              if cfg.shared_expert_intermediate_size else None)
    return SparseMoeBlock(cfg, ops, linears, shared)


class LlamaModel(nn.Module):
    # The final norm's kind (Gemma's scales by one plus its weight).
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 ops: type[LayerOps], linears: LinearFactory,
                 stage: PipelineStage = PipelineStage()) -> None:
        super().__init__()
        self.layer_range = stage.layer_range(cfg.num_layers)
        self.embed_tokens = (VocabEmbedding(cfg.vocab_size, cfg.hidden_size, linears.dtype,
                                            linears.device, linears.tp)
                             if stage.is_first else None)
        layer = self.layer_factory(cfg, backend, max_positions, ops, linears)
        self.layers = nn.ModuleList(layer(i) if i in self.layer_range else nn.Identity()
                                    for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, ops) \
            if stage.is_last else None
        self.embedding_multiplier = cfg.embedding_multiplier  # Granite's; 1 elsewhere
        # Layers whose input (the residual stream entering them) an EAGLE-3 head reads
        # (``models/eagle3.py``); empty: none, and the forward returns the hidden states alone.
        self.aux_layers: tuple[int, ...] = ()

    @staticmethod
    def layer_factory(cfg: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                      ops: type[LayerOps], linears: LinearFactory) -> Callable[[int], nn.Module]:
        """What makes decoder layer ``i`` (only this stage's are made), each taking
        ``(positions, hidden, residual, kv_cache, ctx)`` and returning the next
        ``(hidden, residual)``."""
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                 ops, rotary_dim=cfg.rotary_dim)
        return lambda i: LlamaDecoderLayer(cfg, rotary, backend, ops, linears,
                                           moe=cfg.is_moe_layer(i), window=cfg.layer_window(i))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        return hidden

    def forward(self, input_ids, positions, kv_caches, ctx: ForwardContext,
                incoming: Intermediate | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | Intermediate:
        """``kv_caches``: this stage's layers' pools; ``incoming``: the previous stage's
        output (None on the first stage, which embeds ``input_ids``). A stage before the last
        returns its ``Intermediate`` for the next."""
        hidden, residual = (self.embed(input_ids), None) if incoming is None else incoming
        aux = []
        layers = itertools.islice(self.layers, self.layer_range.start, self.layer_range.stop)
        for i, layer, kv_cache in zip(self.layer_range, layers, kv_caches):
            if i in self.aux_layers:  # a copy: the fused norms add into the residual in place
                aux.append(hidden.clone() if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, kv_cache, ctx)
        if self.norm is None:
            return Intermediate(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        if not self.aux_layers:
            return hidden
        # In the order the head's config names them: its fusing projection reads them so.
        order = sorted(set(self.aux_layers))
        return hidden, torch.cat([aux[order.index(i)] for i in self.aux_layers], dim=-1)


class LlamaForCausalLM(nn.Module):
    # Where the decoder layers are: CPU weight offload (models/offload.py) streams them.
    layers_prefix = "model.layers"
    # The decoder (Gemma's has its own layers, norms and embedding scale).
    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 ops: type[LayerOps], linears: LinearFactory, lm_head: bool = True,
                 stage: PipelineStage = PipelineStage()) -> None:
        """``lm_head=False`` (``--runner pooling``, and always for a bare base model): no
        head at all, so a checkpoint's ``lm_head.weight`` is skipped, never held. ``stage``:
        the pipeline stage this model is (the whole model by default)."""
        super().__init__()
        self.config = cfg
        self.stage = stage
        self.model = self.model_class(cfg, backend, max_positions, ops, linears, stage)
        self.tp = linears.tp
        # Each rank holds a slice of the vocabulary, as the embedding does (so a tied head
        # shares its table). The head stays in the checkpoint's precision under at-load
        # quantization.
        self.lm_head = (linears.column(cfg.hidden_size, [linears.tp.padded_part(cfg.vocab_size)],
                                       quantize_at_load=False)
                        if lm_head and stage.is_last else None)
        # A sequence classifier's head, replicated on every rank of the last stage (the
        # driver's pooler reads it).
        self.score = (nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False,
                                dtype=linears.dtype, device=linears.device)
                      if cfg.num_labels and stage.is_last else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], ctx: ForwardContext,
                incoming: Intermediate | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | Intermediate:
        """Hidden states ``[num_tokens, hidden]`` for a packed batch of tokens; ``ctx`` is the
        step's attention metadata and per-row extras, handed to every layer. With
        ``model.aux_layers`` set, also the inputs of those layers side by side
        (``[num_tokens, len(aux_layers) * hidden]``). A pipeline stage after the first starts
        from ``incoming``; one before the last returns what the next starts from."""
        return self.model(input_ids, positions, kv_caches, ctx, incoming)

    def get_input_embeddings(self) -> VocabEmbedding | None:
        """The token embedding table (None on a pipeline stage after the first)."""
        return self.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary; under tensor parallelism only the stage's first
        rank, which samples, gets them (the other ranks get None)."""
        if self.lm_head is None:
            raise RuntimeError("this model was built without an LM head (--runner pooling): "
                               "it computes hidden states, never logits")
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite's
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap  # Gemma 2's
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather_to_first(logits)
        return None if logits is None else logits[:, :self.config.vocab_size]

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of a Hugging Face checkpoint this model (this stage) reads, with its
        shape."""
        shapes = checkpoint_shapes(self.config, lm_head=self.lm_head is not None)
        return {name: shape for name, shape in shapes.items() if self._reads(name)}

    def _reads(self, name: str) -> bool:
        """Whether this pipeline stage holds checkpoint tensor ``name`` (a canonical name): its
        layers' tensors, the embedding on the first stage (and on the last, for a tied LM
        head), the final norm and the heads on the last."""
        if name.startswith(self.layers_prefix + "."):
            return int(name.split(".")[2]) in self.model.layer_range
        if name.startswith("model.embed_tokens."):
            return self.stage.is_first or (self.stage.is_last and self._reads_tied_head)
        if name.startswith(("model.norm.", "lm_head.", "score.")):
            return self.stage.is_last
        return True

    @property
    def _reads_tied_head(self) -> bool:
        return self.config.tie_word_embeddings and self.lm_head is not None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        """Hand checkpoint weights to their modules: q/k/v and gate/up shards to the fused
        linear layers, everything else copied into its parameter. Raises if anything is left
        unloaded, so a partial checkpoint cannot run silently. Names may lack the ``model.``
        prefix (a bare base model's, ``canonical_weights``); without an LM head, the
        checkpoint's is skipped."""
        params = dict(self.named_parameters())  # norms and biases; weights come later
        loaded: set[str] = set()
        for name, weight in self.canonical_weights(weights):
            if "rotary_emb.inv_freq" in name or not self._reads(name):
                continue
            if name.startswith("lm_head.") and (self.lm_head is None
                                                or self.config.tie_word_embeddings):
                continue
            if name.startswith("model.embed_tokens.") and self.model.embed_tokens is None:
                self.lm_head.load_shard(0, weight)  # a last stage's tied head: the table
                continue
            expert = expert_weight(name)
            if expert is not None:
                self._experts(name, expert.module).load(expert.expert, expert.proj, weight)
                continue
            target, shard = fused_target(moe_module_name(name))
            owner_name, _, kind = target.rpartition(".")
            owner = submodule(self, owner_name)
            if isinstance(owner, Linear) and kind == "weight" and shard is None \
                    and len(owner.out_parts) > 1:
                load_fused(owner, weight)  # Phi-3's qkv_proj and gate_up_proj
            elif isinstance(owner, Linear) and kind == "weight":
                owner.load_shard(shard or 0, weight)
            elif isinstance(owner, VocabEmbedding):
                owner.load(weight)
            elif isinstance(owner, Linear) and kind == "bias":
                owner.load_bias(shard or 0, weight)
            elif target in params:
                params[target].copy_(weight)
            else:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
            loaded.add(f"{target}#{shard}")
        if self._reads_tied_head and self.model.embed_tokens is not None:
            self.lm_head.set_weight(self.model.embed_tokens.as_weight())
        self._check_complete(loaded)

    def _experts(self, name: str, module: str) -> FusedExperts:
        owner = submodule(self, module)
        if not isinstance(owner, FusedExperts):
            raise ValueError(f"checkpoint tensor {name} is an expert's, but the config makes "
                             "that layer dense")
        return owner

    @staticmethod
    def canonical_weights(weights: Iterable[tuple[str, LoadedWeight]]
                          ) -> Iterator[tuple[str, LoadedWeight]]:
        """``weights`` under this class's names: a bare base model's checkpoint (``XModel``,
        saved from transformers' base class) names its tensors ``embed_tokens.weight``,
        ``layers.0...``, ``norm.weight``, without the ``model.`` prefix of ``XForCausalLM``'s
        (vLLM's pooling adapter maps them alike). Names already prefixed, and a classifier's
        ``score.weight``, pass unchanged."""
        for name, weight in weights:
            if not name.startswith(("model.", "lm_head.", "score.")):
                name = "model." + name
            yield name, weight

    def _check_complete(self, loaded: set[str]) -> None:
        missing = [name for name, m in self.named_modules()
                   if isinstance(m, (Linear, VocabEmbedding, FusedExperts)) and not m.loaded]
        # Experts' parameters, float or quantized stacks: counted through ``loaded`` too.
        experts = tuple(f"{name}." for name, m in self.named_modules()
                        if isinstance(m, FusedExperts))
        for name, _ in self.named_parameters():
            owner_name, _, kind = name.rpartition(".")
            owner = self.get_submodule(owner_name)
            if name.startswith(experts) or (isinstance(owner, (Linear, VocabEmbedding))
                                            and kind != "bias"):
                continue  # weights: counted through ``loaded`` above
            fused = isinstance(owner, Linear) and len(owner.out_sizes) > 1
            shards = range(len(owner.out_sizes)) if fused else [None]
            missing += [f"{name}#{s}" for s in shards if f"{name}#{s}" not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0]}")


def load_fused(owner: Linear, weight: LoadedWeight) -> None:
    """A checkpoint tensor that holds all of a fused layer's shards, their rows one after
    another in the layer's order (Phi-3's q, k, v and gate, up): cut back into the shards,
    each of which the layer then slices for this rank."""
    total = sum(p.full for p in owner.out_parts)
    if weight.shape[0] != total:
        raise ValueError(f"fused weight has {weight.shape[0]} rows, expected {total}")
    start = 0
    for shard, part in enumerate(owner.out_parts):
        owner.load_shard(shard, take_rows(weight, start, part.full))
        start += part.full


def checkpoint_shapes(c: ModelArchConfig, lm_head: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this architecture holds, with its shape
    (``lm_head=False``: what a model built without the head reads of it)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight":
                                          (c.vocab_size, c.hidden_size),
                                          "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings and lm_head:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    if c.num_labels:
        shapes["score.weight"] = (c.num_labels, c.hidden_size)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = {"input_layernorm.weight": (c.hidden_size,),
             "post_attention_layernorm.weight": (c.hidden_size,),
             **({"pre_feedforward_layernorm.weight": (c.hidden_size,),
                 "post_feedforward_layernorm.weight": (c.hidden_size,)}
                if c.sandwich_norms else {}),
             "self_attn.q_proj.weight": (q, c.hidden_size),
             "self_attn.k_proj.weight": (kv, c.hidden_size),
             "self_attn.v_proj.weight": (kv, c.hidden_size),
             "self_attn.o_proj.weight": (c.hidden_size, q)}
    if c.fused_checkpoint:
        for name in ("q_proj", "k_proj", "v_proj"):
            del layer[f"self_attn.{name}.weight"]
        layer["self_attn.qkv_proj.weight"] = (q + 2 * kv, c.hidden_size)
    if c.qk_norm:
        layer.update({"self_attn.q_norm.weight": (c.head_dim,),
                      "self_attn.k_norm.weight": (c.head_dim,)})
    if c.attention_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                      "self_attn.v_proj.bias": (kv,)})
    for i in range(c.num_layers):
        mlp = _moe_shapes(c) if c.is_moe_layer(i) else _mlp_shapes(c)
        shapes.update({f"model.layers.{i}.{name}": shape
                       for name, shape in (layer | mlp).items()})
    return shapes


def _mlp_shapes(c: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    if c.fused_checkpoint:
        return {"mlp.gate_up_proj.weight": (2 * c.intermediate_size, c.hidden_size),
                "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size)}
    return {"mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size)}


def _moe_shapes(c: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """A sparse block's tensors under the checkpoint's names: Mixtral's
    ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen's ``mlp.experts.{e}.gate_proj/...`` and
    Qwen2-MoE's ``mlp.shared_expert.gate_proj/...`` and ``mlp.shared_expert_gate``."""
    mixtral = c.architecture == "MixtralForCausalLM"
    block = "block_sparse_moe" if mixtral else "mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    inter, hidden = c.moe_intermediate_size, c.hidden_size
    shapes = {f"{block}.gate.weight": (c.num_experts, hidden)}
    for e in range(c.num_experts):
        for name, shape in zip(names, ((inter, hidden), (inter, hidden), (hidden, inter))):
            shapes[f"{block}.experts.{e}.{name}.weight"] = shape
    shared = c.shared_expert_intermediate_size
    if shared:
        shapes.update({"mlp.shared_expert.gate_proj.weight": (shared, hidden),
                       "mlp.shared_expert.up_proj.weight": (shared, hidden),
                       "mlp.shared_expert.down_proj.weight": (hidden, shared),
                       "mlp.shared_expert_gate.weight": (1, hidden)})
    return shapes


def submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def fused_target(name: str) -> tuple[str, int | None]:
    for fragment, (fused, shard) in _STACKED.items():
        if f".{fragment}." in name:
            return name.replace(fragment, fused), shard
    return name, None
