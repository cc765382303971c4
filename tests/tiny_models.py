"""Random-weight checkpoints of real architectures, written as Hugging Face folders, and the
helpers the engine tests build on them: random prompts, CPU engines with a given pool, and
transformers' model as the reference."""

from __future__ import annotations

import copy
import random
from functools import cache
from pathlib import Path

import torch

VOCAB = 384
# What the two Qwen3 checkpoints share; each adds its heads and embedding.
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64,
              num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
              max_position_embeddings=1024, attention_bias=False, use_sliding_window=False)

_QWEN3_MOE = dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, tie_word_embeddings=False, num_experts=8,
                  num_experts_per_tok=3, moe_intermediate_size=32, decoder_sparse_step=1)

ARCH_CONFIGS = {
    # Llama-3 shape: GQA 4:1, llama3 rope scaling, untied embeddings.
    "llama3": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=1024, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=256),
    ),
    # Qwen2 shape: q/k/v biases, tied embeddings, GQA 2:1.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
        intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=1024, tie_word_embeddings=True, use_sliding_window=False,
        sliding_window=None,
    ),
    # Qwen3 shape: q/k norms, head_dim 32 (not hidden / heads = 16), GQA 2:1, untied.
    "qwen3": dict(_QWEN3, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, tie_word_embeddings=False),
    # Qwen3-0.6B's proportions: head_dim 16 over 8 heads of a 64-wide model, GQA 4:1, tied.
    "qwen3-tied": dict(_QWEN3, intermediate_size=128, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    # Mistral shape: GQA 4:1, head_dim 16, no sliding window in the tested range.
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=64,
        intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=1024, tie_word_embeddings=False, sliding_window=None,
    ),
    # Mixtral shape: Mistral attention; 6 experts of 48, top 2, always renormalised.
    "mixtral": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=64,
        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=1024, tie_word_embeddings=False, sliding_window=None,
        num_local_experts=6, num_experts_per_tok=2,
    ),
    # Phi-4-mini's shape: fused qkv_proj / gate_up_proj tensors, rotary on the first 0.75 of
    # each head (12 of 16 features), GQA 2:1, tied; a sliding window past the context.
    "phi3": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=64,
        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        partial_rotary_factor=0.75, max_position_embeddings=1024, sliding_window=2047,
        tie_word_embeddings=True, pad_token_id=2,
    ),
    # Phi-3-mini-128k's shape: longrope (short factors within 256 original positions, the
    # attention factor of a 4x longer context), whole-head rotary, MHA, untied.
    "phi3-longrope": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=64,
        intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=1024, original_max_position_embeddings=256,
        rope_scaling=dict(type="longrope",
                          short_factor=[1.0, 1.05, 1.2, 1.5, 2.0, 3.0, 4.5, 6.0],
                          long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]),
        sliding_window=None, tie_word_embeddings=False, pad_token_id=2,
    ),
    # Granite 3.x's scalars, made non-trivial: embeddings x 6, each residual branch x 0.3,
    # softmax scale 0.4 (not 1/sqrt(16)), logits / 5; tied, GQA 4:1.
    "granite": dict(
        architectures=["GraniteForCausalLM"], model_type="granite", hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=1024, tie_word_embeddings=True, embedding_multiplier=6.0,
        residual_multiplier=0.3, attention_multiplier=0.4, logits_scaling=5.0,
    ),
    # Qwen1.5-MoE-A2.7B's layout: Qwen2 attention (q/k/v biases), 8 experts of 32, top 3 as
    # the softmax left them (norm_topk_prob unset: false), and a shared expert of 48 beside
    # them, gated per token.
    "qwen2-moe": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=64,
        intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=1024, tie_word_embeddings=False, use_sliding_window=False,
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=1,
    ),
    # Qwen3-30B-A3B's layout: Qwen3 attention, 8 experts of 32, top 3 renormalised.
    "qwen3-moe": dict(_QWEN3_MOE, norm_topk_prob=True),
    # Gemma 2's layout at a window of 8 (layers 0 and 2 local, transformers' default rule):
    # head_dim 24 (not hidden / heads), softmax scale 20 ** -0.5 (not head_dim's), GQA 2:1,
    # tied; caps small enough to bend the random model's scores (about 0.5) and logits.
    "gemma2": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=64,
        intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=1024, query_pre_attn_scalar=20, sliding_window=8,
        attn_logit_softcapping=1.0, final_logit_softcapping=1.5,
    ),
    # Gemma 3's layout at a window of 8: layers 0 and 2 local (rotated with base 1e4), layer 1
    # global (base 1e6, linear scaling x4, as the 4B's); q/k norms, head_dim 32, GQA 4:1,
    # tied. attn_logit_softcapping is set to show it stays unapplied, as transformers'
    # Gemma 3 leaves it.
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=64,
        intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=1024,
        query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=1.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0,
                                                rope_theta=1000000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)},
    ),
    # Top-k weights as the softmax left them (norm_topk_prob false, transformers' default),
    # and layer 1 a dense MLP of intermediate_size (mlp_only_layers).
    "qwen3-moe-dense1": dict(_QWEN3_MOE, norm_topk_prob=False, mlp_only_layers=[1]),
}


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, paged attention",
              "naïve café – 日本語 テスト 🚀✨", "serving large language models fast"] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def write_tiny_model(folder: Path, arch: str, seed: int = 0, base_model: bool = False,
                     num_labels: int = 0, **overrides) -> Path:
    """A random-weight float32 checkpoint plus a small byte-level BPE tokenizer; ``overrides``
    change the architecture's config (``hidden_size=128``). ``base_model``: saved from
    transformers' bare base class, as embedding models are published (``MistralModel``:
    no LM head, tensor names without ``model.``). ``num_labels``: saved from its
    ``XForSequenceClassification`` (a ``score`` head of that many labels, ``id2label``,
    ``pad_token_id`` 2)."""
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )

    folder.mkdir(parents=True, exist_ok=True)
    # A deep copy: transformers' config writes into nested dicts it is given (rope_scaling
    # gains original_max_position_embeddings), which would change ARCH_CONFIGS for every
    # later test of the process.
    cfg_dict = {**copy.deepcopy(ARCH_CONFIGS[arch]), "vocab_size": VOCAB, "bos_token_id": 0,
                "eos_token_id": 1, **overrides}
    if num_labels:
        cfg_dict.update(num_labels=num_labels, pad_token_id=2,
                        id2label={i: f"label_{i}" for i in range(num_labels)})
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    auto = (AutoModelForSequenceClassification if num_labels
            else AutoModel if base_model else AutoModelForCausalLM)
    model = auto.from_config(config, dtype=torch.float32)
    # Larger than the default init so greedy choices are decisive, not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)  # not all ones: a swapped or skipped load shows
            elif name.endswith("norm.weight") and "gemma" in config.model_type:
                p.uniform_(-0.5, 0.5)  # Gemma's 1 + w: zeros (its init) would hide a swap
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def save_tokenizer(folder: Path) -> None:
    """The small byte-level BPE tokenizer every tiny checkpoint ships."""
    _train_tokenizer().save_pretrained(folder)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` ordinary token ids (0-2 are the special tokens)."""
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def random_prompts(seed: int | str, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_tokens(rng, n) for n in lengths]


def make_llm(folder: Path, *, num_blocks: int | None = None, **kwargs):
    """An engine (on the CPU unless ``device`` says) with a 4 MiB KV pool, or one of exactly
    ``num_blocks`` blocks (counted on the CPU)."""
    from pagedserve import LLM

    kwargs.setdefault("kv_cache_memory_bytes", 4 << 20)
    kwargs.setdefault("device", "cpu")
    if num_blocks is not None:
        block_bytes = _kv_bytes_per_block(folder, kwargs.get("block_size", 16))
        kwargs["kv_cache_memory_bytes"] = num_blocks * block_bytes
    return LLM(model=str(folder), **kwargs)


@cache
def _kv_bytes_per_block(folder: Path, block_size: int) -> int:
    from pagedserve import LLM

    probe = LLM(model=str(folder), device="cpu", block_size=block_size,
                kv_cache_memory_bytes=1 << 20)
    return probe.engine.kv_bytes_per_block


# transformers' own attention, the reference: its SDPA path may drop what SDPA lacks
# (transformers 5.17 ran Gemma 2 there without attn_logit_softcapping; 5.24 turned it off).
REFERENCE_ATTENTION = "eager"


@cache
def hf_model(folder: Path):
    """transformers' float32 model of a checkpoint folder, loaded once per test process. Shared:
    callers pass generation options to ``generate`` rather than change the model."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=REFERENCE_ATTENTION).eval()


def hf_model_float64(folder: Path):
    """transformers' float64 model of a checkpoint folder (a mixture-of-experts model's
    experts eager: their grouped matmul takes no float64)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                attn_implementation=REFERENCE_ATTENTION,
                                                experts_implementation="eager").eval()


def decode_logprob_error(llm, hf, prompt: list[int], new_tokens: int) -> float:
    """The largest gap between the engine's logprobs of ``new_tokens`` greedy tokens (its top 3
    at each step; no prompt logprobs, so the prompt may come from the prefix cache) and the
    log-softmax of ``hf``'s logits for the whole sequence, taken in one forward."""
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=3)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0]
    reference = logits[len(prompt) - 1:].double().log_softmax(-1)
    return max(abs(lp.logprob - reference[step, token].item())
               for step, position in enumerate(out.logprobs) for token, lp in position.items())


def prompt_logprob_error(llm, hf, prompt: list[int]) -> float:
    """The largest gap between the engine's prompt logprobs (its top 5 and the actual token
    at each position) and the log-softmax of ``hf``'s logits for the whole prompt, taken in
    one forward."""
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)
    got = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    return max(abs(lp.logprob - reference[i - 1, token].item())
               for i, position in enumerate(got) if position is not None
               for token, lp in position.items())


def hf_pooled(folder, prompts, pooling_type: str, normalize: bool) -> list[torch.Tensor]:
    """transformers' float64 hidden states of the prompts (``AutoModel``: the base model,
    after the final norm) as one right-padded batch, pooled over each prompt's own tokens (the
    padding masked out): the reference for ``runner="pooling"``."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(folder, dtype=torch.float64).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    with torch.no_grad():
        hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    lengths = mask.sum(1)
    if pooling_type == "LAST":
        pooled = hidden[torch.arange(len(prompts)), lengths - 1]
    elif pooling_type == "CLS":
        pooled = hidden[:, 0]
    else:
        pooled = (hidden * mask[..., None]).sum(1) / lengths[:, None]
    return list(torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled)


def hf_classified(folder, prompts) -> list[torch.Tensor]:
    """transformers' float64 label probabilities of the prompts (``hf_logits``), softmax over
    the labels, sigmoid for one: the reference for ``LLM.classify``."""
    logits = torch.stack(hf_logits(folder, prompts))
    return list(logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1))


def hf_logits(folder, prompts) -> list[torch.Tensor]:
    """transformers' float64 raw logits of the prompts (``AutoModelForSequenceClassification``
    on one right-padded batch, read at each prompt's last non-pad token): the reference for
    ``use_activation=False``."""
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float64).eval()
    pad = hf.config.pad_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([p + [pad] * (width - len(p)) for p in prompts])
    with torch.no_grad():
        return list(hf(input_ids=ids, attention_mask=(ids != pad).long()).logits)


def hf_scores(folder, pairs: list[tuple[list[int], list[int]]], pooling_type: str = "LAST"
              ) -> list[float]:
    """The cosine similarity of each pair's ``hf_pooled`` embeddings (unnormalized), in
    float64: the reference for ``LLM.score``, ``/v1/score`` and ``/v1/rerank``."""
    pooled = hf_pooled(folder, [p for pair in pairs for p in pair], pooling_type, False)
    return [float(a @ b / (a.norm() * b.norm())) for a, b in zip(pooled[::2], pooled[1::2],
                                                                 strict=True)]


def hf_model_of_source(source):
    """transformers' float32 model of a source whose folder transformers cannot read itself
    (a converted GGUF keeps block tensors): its config, and its weights dequantized."""
    from pagedserve.bench.hf_model import load_hf_model

    return load_hf_model(source, torch.float32, "cpu")


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation, run to full length as with ``ignore_eos``."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == new_tokens  # a stop token would have ended it early
    return tokens


def assert_greedy_matches(llm, hf, prompts: list[list[int]], new_tokens: int = 16,
                          rel_tol: float = 1e-3, lora_request=None) -> int:
    """The engine's greedy tokens equal transformers' on every prompt, except that at the
    first differing step the two candidates may be a near-tie in transformers' logits (within
    ``rel_tol``): rounding may break a tie either way, and the comparison of that prompt stops
    there. Returns how many prompts matched to the end. ``lora_request``: the engine runs
    every prompt with this adapter (``hf`` then being PEFT's model of it)."""
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    exact = 0
    for prompt, out in zip(prompts, outputs):
        ours, ref = out.outputs[0].token_ids, hf_greedy(hf, prompt, new_tokens)
        step = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if step is None:
            assert len(ours) == len(ref)
            exact += 1
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ref[:step]])).logits[0, -1].double()
        a, b = logits[ref[step]].item(), logits[ours[step]].item()
        assert abs(a - b) <= rel_tol * max(abs(a), abs(b)), (
            f"diverged at step {step}: transformers {ref[step]} ({a}), engine {ours[step]} ({b})")
    return exact


def hf_beams(model, prompt: list[int], width: int, n: int, new_tokens: int, eos: int,
             length_penalty: float = 1.0, early_stopping: bool | str = False) -> list[list[int]]:
    """transformers' ``n`` returned beams of ``width``, best first, each cut after its stop
    token (the padding is eos)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), num_beams=width, num_return_sequences=n, do_sample=False,
            max_new_tokens=new_tokens, length_penalty=length_penalty,
            early_stopping=early_stopping, eos_token_id=eos, pad_token_id=eos)
    beams = [row[len(prompt):] for row in out.tolist()]
    return [b[:b.index(eos) + 1] if eos in b else b for b in beams]
