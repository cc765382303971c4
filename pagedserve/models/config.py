"""The architecture facts our model code needs, read from a Hugging Face ``config.json`` dict."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                           "Qwen3MoeForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Qwen2 and Qwen3 configs carry a sliding_window that only applies with use_sliding_window.
_WINDOW_FLAG_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM",
                              "Qwen3MoeForCausalLM")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Multimodal checkpoints served as their language model, text only: the supported
# architecture of their ``text_config`` (Gemma 3 4B-27B are published only as these).
LANGUAGE_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# Qwen2 attention: q/k/v biases.
_QWEN2_ATTENTION = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
# Qwen3 attention: per-head q/k norms, no attention biases.
_QWEN3_ATTENTION = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


class UnsupportedModel(ValueError):
    """The checkpoint's architecture has no model code here."""


# The suffixes of a checkpoint's architecture that name a supported ``XForCausalLM``'s decoder
# under another head: the bare base model (no head) and the sequence classifier.
BASE_MODEL, CLASSIFIER = "Model", "ForSequenceClassification"


def resolve_architecture(names: list[str]) -> tuple[str, str] | None:
    """The supported ``*ForCausalLM`` architecture a checkpoint's ``architectures`` name, and
    its head: "" (the LM head), ``BASE_MODEL`` for the bare base model ``XModel`` (e5-mistral's
    ``MistralModel``, gte's ``Qwen2Model``, the decoder without a head, served for embeddings
    alone) or ``CLASSIFIER`` for ``XForSequenceClassification`` (the decoder and a linear
    ``score`` head over its last token, served for classification alone). Any ``XModel`` or
    ``XForSequenceClassification`` whose ``XForCausalLM`` is supported is, as vLLM's registry
    maps them. None: no name is supported."""
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name, ""
        for head in (BASE_MODEL, CLASSIFIER):
            causal = name.removesuffix(head) + "ForCausalLM"
            if name.endswith(head) and causal in SUPPORTED_ARCHITECTURES:
                return causal, head
    return None


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # the supported *ForCausalLM name, also for a bare base model
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    # An RMSNorm over each head's q and k vectors (weights of head_dim) before the rotation:
    # Qwen3's ``self_attn.q_norm`` / ``k_norm``.
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    # Sliding-window attention: a query sees itself and the ``sliding_window - 1`` keys before
    # it (``AttentionBackend``), in the layers of ``sliding_layers`` (Gemma's local layers),
    # or in every layer where that is None (Mistral, Phi-3). None: no window.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # The checkpoint is the bare base model (``XModel``): no LM head, only --runner pooling.
    base_model: bool = False
    # A sequence classifier (``XForSequenceClassification``, only --runner pooling): a
    # ``score`` head [num_labels, hidden] (no bias) over the last token's final hidden state;
    # 0 for any other checkpoint. ``labels`` are its ``id2label`` names, in label order;
    # ``problem_type`` picks the activation (``classifier_activation``); where it names none,
    # ``saved_activation`` may: a cross-encoder's as sentence-transformers saves it.
    num_labels: int = 0
    labels: tuple[str, ...] = ()
    problem_type: str | None = None
    saved_activation: str | None = None
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): ``num_experts`` SwiGLU experts of
    # ``moe_intermediate_size`` each, ``num_experts_per_tok`` chosen per token by a softmax
    # router, their weights renormalised to sum to 1 where ``norm_topk_prob``. The layers in
    # ``moe_layers`` have the sparse block; the others a dense MLP of ``intermediate_size``
    # (Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``). 0 experts: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # Qwen2-MoE's shared expert: a dense SwiGLU MLP of this size beside the routed experts of
    # every sparse block, its output scaled by ``sigmoid(shared_expert_gate(x))``; 0: none.
    shared_expert_intermediate_size: int = 0
    # Phi-3: checkpoints store q/k/v as one ``self_attn.qkv_proj`` tensor and gate/up as one
    # ``mlp.gate_up_proj`` (rows concatenated in that order); the loader splits them.
    fused_checkpoint: bool = False
    # Rotary embeddings on the first ``rotary_dim`` features of each head only, the rest
    # passed through (Phi-4-mini's partial_rotary_factor 0.75); head_dim unless set.
    partial_rotary_factor: float = 1.0
    # Granite: embeddings times ``embedding_multiplier``; each residual branch (attention,
    # MLP output) times ``residual_multiplier`` before its add; ``attention_multiplier`` the
    # softmax scale in place of 1/sqrt(head_dim); logits divided by ``logits_scaling``.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Gemma 2 and 3 (``models/gemma.py``): each sublayer's output is normalised too
    # (``post_attention_layernorm`` on attention's, ``pre_/post_feedforward_layernorm`` around
    # the MLP's). Gemma 2 caps attention scores (``attn_logit_softcap``, ``AttentionBackend``)
    # and logits (``final_logit_softcap``: ``cap * tanh(logits / cap)``); None: no cap. Gemma 3's
    # local layers rotate with ``rope_local_theta`` and no scaling, its global layers with
    # ``rope_theta`` and ``rope_scaling``; None: every layer as the global ones.
    sandwich_norms: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    rope_local_theta: float | None = None
    # Matryoshka embeddings (vLLM reads the same keys): a prefix of the pooled vector is an
    # embedding too. ``matryoshka_dimensions`` lists the sizes trained, when the config
    # names them; ``is_matryoshka`` alone allows any size up to hidden_size.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def checkpoint_architecture(self) -> str:
        """The name as the checkpoint's config says it (``MistralModel`` for a base model)."""
        if self.base_model or self.num_labels:
            head = BASE_MODEL if self.base_model else CLASSIFIER
            return self.architecture.removesuffix("ForCausalLM") + head
        return self.architecture

    @property
    def lm_head(self) -> bool:
        """Whether the checkpoint has an LM head, so it can generate."""
        return not (self.base_model or self.num_labels)

    @property
    def classifier_activation(self) -> str:
        """How a classifier's logits become its ``probs``, as vLLM picks (after transformers'
        loss for the config's ``problem_type``): "identity" for regression, "sigmoid" for
        multi-label classification; where ``problem_type`` is unset, the saved
        sentence-transformers activation if any; else "sigmoid" for a single label and
        "softmax" for several."""
        if self.problem_type == "regression":
            return "identity"
        if self.problem_type == "multi_label_classification":
            return "sigmoid"
        if self.saved_activation is not None:
            return self.saved_activation
        return "sigmoid" if self.num_labels < 2 else "softmax"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``'s attention; None: the whole context."""
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        """The softmax scale every attention backend is given."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return self.head_dim ** -0.5

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        archs = cfg.get("architectures") or []
        if any(name in LANGUAGE_MODELS for name in archs):
            cfg = _language_model_config(cfg)
            archs = cfg["architectures"]
        found = resolve_architecture(archs)
        if found is None:
            raise UnsupportedModel(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}, and the bare XModel and "
                "the XForSequenceClassification of each XForCausalLM (for embeddings and "
                "classification, --runner pooling)"
            )
        arch, head = found
        num_heads = cfg["num_attention_heads"]
        qwen3 = arch in _QWEN3_ATTENTION
        if qwen3 and cfg.get("attention_bias", False):
            raise UnsupportedModel("Qwen3 with attention_bias (biases on q/k/v and o_proj) is "
                                   "not supported; the released Qwen3 models have none")
        # transformers' Qwen3Config defaults head_dim to 128 and Gemma's to 256, whatever
        # hidden/heads is (Qwen3MoeConfig has no default: hidden / heads).
        head_dim = cfg.get("head_dim") or _DEFAULT_HEAD_DIMS.get(
            arch, cfg["hidden_size"] // num_heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Qwen2 has q/k/v biases (transformers 5's Qwen2MoeConfig names them qkv_bias, on
        # unless said); Llama exposes them as a flag.
        bias = ((arch in _QWEN2_ATTENTION and bool(cfg.get("qkv_bias", True)))
                or bool(cfg.get("attention_bias", False)))
        window, max_positions = cfg.get("sliding_window"), cfg.get("max_position_embeddings", 2048)
        if arch in _WINDOW_FLAG_ARCHITECTURES:
            # transformers' rules for which Qwen layers slide differ by model and version
            # (Qwen2: from max_window_layers on; Qwen2-MoE: alternate layers below it;
            # Qwen3-MoE: all), and no released Qwen model turns use_sliding_window on: with it
            # the context stays inside one window, where every rule agrees, and no layer
            # needs one.
            if cfg.get("use_sliding_window", False) and window:
                max_positions = min(max_positions, window)
            window = None
        if cfg.get("mlp_bias", False):
            raise UnsupportedModel(f"{arch} with mlp_bias (biases on the MLP projections) is "
                                   "not supported")
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters") or {}
        if rope_theta is None:
            # transformers 5 folds rope settings into rope_parameters.
            rope_theta = params.get("rope_theta", 10000.0)
            if rope_scaling is None and params.get("rope_type", "default") != "default":
                rope_scaling = params
        phi3 = _phi3_fields(arch, cfg, params, rope_scaling)
        rope_scaling = phi3.pop("rope_scaling", rope_scaling)
        gemma = _gemma_fields(arch, cfg, rope_scaling)
        rope_theta = gemma.pop("rope_theta", rope_theta)
        rope_scaling = gemma.pop("rope_scaling", rope_scaling)
        window = gemma.pop("sliding_window", window)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_positions,
            # Gemma's configs leave it out: tied, as transformers' defaults say.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in _GEMMA)),
            attention_bias=bias,
            qk_norm=qwen3 or arch == "Gemma3ForCausalLM",
            rope_scaling=rope_scaling,
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            base_model=head == BASE_MODEL,
            raw=cfg,
            **(_classifier_fields(cfg) if head == CLASSIFIER else {}),
            **_moe_fields(arch, cfg),
            **phi3,
            **_granite_fields(arch, cfg),
            **gemma,
            **_matryoshka_fields(cfg),
        )

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


def _classifier_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """A sequence classifier's labels: transformers saves ``id2label`` (its length is
    ``num_labels``), older configs ``num_labels`` alone (labels then ``LABEL_i``)."""
    id2label = cfg.get("id2label") or {}
    num_labels = len(id2label) or int(cfg.get("num_labels", 2))
    if num_labels < 1:
        raise UnsupportedModel(f"a sequence classifier needs num_labels >= 1, got {num_labels}")
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}")))
                   for i in range(num_labels))
    problem_type = cfg.get("problem_type")
    saved = None if problem_type in _PROBLEM_TYPES else _saved_activation(cfg)
    return dict(num_labels=num_labels, labels=labels, problem_type=problem_type,
                saved_activation=saved)


_PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
# The torch.nn.modules activations a saved cross-encoder may name (the class's last name):
# Sigmoid and Softmax are the default's (vLLM runs either as sigmoid for one label, softmax
# for several); other modules are refused.
_SAVED_ACTIVATIONS = {"Identity": "identity", "Tanh": "tanh", "Sigmoid": None, "Softmax": None}


def _saved_activation(cfg: dict[str, Any]) -> str | None:
    """A cross-encoder's activation as vLLM reads it from config.json: sentence-transformers
    v4's ``sentence_transformers.activation_fn``, else older versions'
    ``sbert_ce_default_activation_function``; a qualified name under ``torch.nn.modules``.
    None: the default."""
    saved = cfg.get("sentence_transformers")
    name = (saved["activation_fn"] if isinstance(saved, dict) and "activation_fn" in saved
            else cfg.get("sbert_ce_default_activation_function"))
    if name is None:
        return None
    module, _, cls = str(name).rpartition(".")
    if not module.startswith("torch.nn.modules") or cls not in _SAVED_ACTIVATIONS:
        raise UnsupportedModel(
            f"config.json's cross-encoder activation {name!r} is not one pagedserve runs: "
            f"torch.nn.modules' {', '.join(_SAVED_ACTIVATIONS)}")
    return _SAVED_ACTIVATIONS[cls]


def _matryoshka_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """``is_matryoshka`` and ``matryoshka_dimensions`` as vLLM reads them: a model listing
    its sizes is Matryoshka whatever ``is_matryoshka`` says."""
    sizes = cfg.get("matryoshka_dimensions") or ()
    if not isinstance(sizes, list | tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in sizes):
        raise UnsupportedModel(f"config.json's matryoshka_dimensions must be a list of "
                               f"positive integers, got {sizes!r:.80}")
    return dict(is_matryoshka=bool(sizes) or bool(cfg.get("is_matryoshka", False)),
                matryoshka_dimensions=tuple(sorted(set(sizes))))


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config; {} for a
    dense model. Mixtral routes every layer, its experts of ``intermediate_size`` and always
    renormalised; the Qwen models route layer ``i`` unless it is in ``mlp_only_layers`` or
    ``i + 1`` is no multiple of ``decoder_sparse_step`` (as transformers builds them), and
    Qwen2-MoE's sparse blocks add its shared expert."""
    if arch not in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    # transformers 5 saves Qwen3-MoE's num_experts under Mixtral's name, num_local_experts.
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    layers = range(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return dict(num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                    moe_layers=tuple(layers))
    dense = set(cfg.get("mlp_only_layers") or ())
    step = cfg.get("decoder_sparse_step", 1) or 1
    sparse = tuple(i for i in layers if experts > 0 and i not in dense and (i + 1) % step == 0)
    qwen2 = arch == "Qwen2MoeForCausalLM"
    # transformers' defaults: Qwen2MoeConfig routes 4 experts a token, Qwen3MoeConfig 8.
    fields = dict(num_experts=experts,
                  num_experts_per_tok=cfg.get("num_experts_per_tok", 4 if qwen2 else 8),
                  moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=sparse)
    if qwen2:  # 5632: Qwen2MoeConfig's default (Qwen1.5-MoE-A2.7B's)
        fields["shared_expert_intermediate_size"] = cfg.get("shared_expert_intermediate_size",
                                                            5632)
    return fields


def _phi3_fields(arch: str, cfg: dict[str, Any], params: dict[str, Any],
                 rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Phi-3's fused checkpoint tensors, its partial rotary factor (top-level in older
    configs, in rope_parameters in transformers 5) and its longrope settings, whose
    ``original_max_position_embeddings`` older configs keep beside ``rope_scaling``."""
    if arch != "Phi3ForCausalLM":
        return {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    fields: dict[str, Any] = dict(fused_checkpoint=True, partial_rotary_factor=float(factor))
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
    if kind in ("longrope", "su"):
        original = (rope_scaling.get("original_max_position_embeddings")
                    or cfg.get("original_max_position_embeddings"))
        fields["rope_scaling"] = {**rope_scaling, "rope_type": "longrope",
                                  "original_max_position_embeddings": original,
                                  "max_position_embeddings":
                                      cfg.get("max_position_embeddings", 2048)}
    return fields


def _language_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's ``text_config`` as its language model's own config: the keys
    the published configs leave out filled with transformers' ``Gemma3TextConfig`` defaults
    (Gemma 3 4B lists five), the stop tokens, dtype and quantization of the top level."""
    from transformers import Gemma3TextConfig  # only for these checkpoints: it is slow to load

    name = next(n for n in cfg["architectures"] if n in LANGUAGE_MODELS)
    text = Gemma3TextConfig(**copy.deepcopy(cfg.get("text_config") or {})).to_dict()
    top = {key: cfg[key] for key in ("bos_token_id", "eos_token_id", "torch_dtype", "dtype",
                                     "quantization_config", "tie_word_embeddings")
           if cfg.get(key) is not None}
    return {**text, **top, "architectures": [LANGUAGE_MODELS[name]]}


_DEFAULT_HEAD_DIMS = {"Qwen3ForCausalLM": 128, "Gemma2ForCausalLM": 256,
                      "Gemma3ForCausalLM": 256}


def _gemma_fields(arch: str, cfg: dict[str, Any],
                  rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma 2's and 3's fields, with transformers' defaults where a config leaves them out:
    the softmax scale ``query_pre_attn_scalar ** -0.5``, the window's layers, the caps, and
    Gemma 3's two rotations. Configs saved by transformers 5 list ``layer_types`` and nest
    Gemma 3's rope settings by layer type (``rope_parameters``); older ones give
    ``sliding_window_pattern`` (Gemma 3: every layer but each 6th slides; Gemma 2: every
    other layer, from the first) and ``rope_theta`` / ``rope_local_base_freq`` /
    ``rope_scaling``."""
    if arch not in _GEMMA:
        return {}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModel(f"{arch} with hidden_activation {act!r}: only "
                               "gelu_pytorch_tanh (every released Gemma 2 and 3) is supported")
    if cfg.get("use_bidirectional_attention") or cfg.get("attention_bias"):
        raise UnsupportedModel(f"{arch} with use_bidirectional_attention (EmbeddingGemma's) or "
                               "attention_bias is not supported")
    gemma3 = arch == "Gemma3ForCausalLM"
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("sliding_window_pattern", 6) if gemma3 else 2
        types = ["sliding_attention" if (i + 1) % every else "full_attention"
                 for i in range(layers)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if len(types) != layers or unknown:
        raise UnsupportedModel(f"{arch}: layer_types must name sliding_attention or "
                               f"full_attention for each of {layers} layers, got {types!r:.120}")
    fields: dict[str, Any] = dict(
        sandwich_norms=True,
        sliding_window=cfg.get("sliding_window", 4096),
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        attention_multiplier=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=cfg.get("final_logit_softcapping", None if gemma3 else 30.0),
        # transformers' Gemma 3 reads attn_logit_softcapping but never applies it.
        attn_logit_softcap=None if gemma3 else cfg.get("attn_logit_softcapping", 50.0))
    if gemma3:
        fields.update(_gemma3_rope(cfg, rope_scaling))
    return fields


def _gemma3_rope(cfg: dict[str, Any], rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma 3's global rotation (``rope_theta``, default 1e6, and its scaling) and its local
    layers' base (``rope_local_base_freq``, default 1e4), from either config form."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: settings by layer type
        full = params["full_attention"]
        local = params.get("sliding_attention") or {}
        scaling = full if full.get("rope_type", "default") != "default" else None
        return dict(rope_theta=full.get("rope_theta", 1e6), rope_scaling=scaling,
                    rope_local_theta=float(local.get("rope_theta", 1e4)))
    theta = cfg.get("rope_theta")
    return dict(rope_theta=1e6 if theta is None else theta, rope_scaling=rope_scaling,
                rope_local_theta=float(cfg.get("rope_local_base_freq", 1e4)))


def _granite_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's four scalars (transformers' GraniteConfig defaults: 1.0 each)."""
    if arch != "GraniteForCausalLM":
        return {}
    return dict(embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
                logits_scaling=float(cfg.get("logits_scaling", 1.0)))
