"""Input processing, the engine's first stage: validate a user request, tokenize its prompt and
build its state: the ``SequenceGroup`` the core schedules and the ``RequestState`` the output
stage fills."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.core.beam_search import BeamSearch
from pagedserve.core.sequence import Sequence, SequenceGroup
from pagedserve.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from pagedserve.engine.request_state import BeamState, RequestState, SequenceState
from pagedserve.outputs import RequestMetrics
from pagedserve.pooling_params import PoolingParams
from pagedserve.sample.logits_processor import check_extra_args
from pagedserve.sample.metadata import check_some_token_allowed, check_token_ids
from pagedserve.sample.seeds import stream_seed
from pagedserve.sampling_params import InvalidSamplingParam, SamplingParams
from pagedserve.structured.spec import check as check_grammar
from pagedserve.structured.spec import grammar_spec

if TYPE_CHECKING:
    from pagedserve.lora.request import LoRARequest


# A priority crosses to the core process as a MessagePack integer: 64 bits.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class PromptTooLong(InvalidSamplingParam):
    """The prompt leaves no room to generate within the context window, or the request could
    not fit the KV pool; ``param`` names what to shorten (``prompt`` or ``max_tokens``)."""


@dataclass(frozen=True)
class InputLimits:
    """What a request is checked against, and the check: plain data, so that a process
    without the engine (the API server's) can check requests before sending them."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    eos_token_ids: frozenset[int]
    num_kv_blocks: int
    block_size: int
    max_grammar_bytes: int
    max_logprobs: int  # --max-logprobs: -1 is the vocabulary size
    speculative: bool = False  # speculative decoding is on
    # --logits-processors by qualified name, each asked whether it serves a request.
    logits_processors: tuple[str, ...] = ()
    runner: str = "generate"  # or "pooling": the engine serves embeddings alone
    hidden_size: int = 0  # an embedding's length
    # The model's Matryoshka sizes (ModelArchConfig's): ``dimensions`` may ask for one.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    num_labels: int = 0  # a sequence classifier's: it serves task "classify" alone
    scheduling_policy: str = "fcfs"  # --scheduling-policy: priority takes request priorities
    # Phi-3 longrope's original_max_position_embeddings: a longer prompt's stream rotates by
    # the long factors (``Sequence.long_rope``). None: the model has no such choice.
    long_rope_after: int | None = None

    def long_rope(self, token_ids: list[int]) -> bool:
        return self.long_rope_after is not None and len(token_ids) > self.long_rope_after

    def check_priority(self, priority: int) -> None:
        """A request's ``priority`` (vLLM's: lower is served earlier) is an int, and one other
        than 0 needs ``--scheduling-policy priority``, as vLLM refuses it otherwise."""
        if isinstance(priority, bool) or not isinstance(priority, int) or \
                not _INT64_MIN <= priority <= _INT64_MAX:
            raise InvalidSamplingParam(
                "priority", f"priority must be an integer in [-2**63, 2**63), got {priority!r:.40}")
        if priority and self.scheduling_policy != "priority":
            raise InvalidSamplingParam(
                "priority", f"priority={priority} is only used with priority scheduling; start "
                "the engine with --scheduling-policy priority (scheduling_policy='priority'), "
                "or leave priority at 0")

    def check(self, token_ids: list[int], params: SamplingParams | PoolingParams) -> int:
        """Validate a tokenized request against the context window, the vocabulary and the
        KV pool; return its max_tokens (0 for a pooling request). This is the only place
        prompts are checked: each error is an ``InvalidSamplingParam`` naming the parameter
        to change."""
        if isinstance(params, PoolingParams):
            return self._check_pooling(token_ids, params)
        if self.runner == "pooling":
            raise InvalidSamplingParam(
                "prompt", "this engine was started with --runner pooling (runner='pooling'): "
                "it computes embeddings (/v1/embeddings, LLM.embed) and generates no text")
        if not token_ids:
            raise InvalidSamplingParam("prompt", "the prompt is empty")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise PromptTooLong(
                "prompt", f"the prompt has {len(token_ids)} tokens but the model's context "
                f"length is {self.max_model_len}; shorten the prompt")
        if params.min_tokens > room:  # it would end at the window, short of min_tokens
            raise PromptTooLong(
                "min_tokens", f"min_tokens={params.min_tokens} is more than the {room} tokens "
                f"the context length of {self.max_model_len} leaves after {len(token_ids)} "
                "prompt tokens; lower min_tokens or shorten the prompt")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise InvalidSamplingParam(
                "prompt", f"prompt token ids must be in [0, {self.vocab_size})")
        self._check_logprobs(params)
        if params.structured_outputs is not None:
            check_grammar(grammar_spec(params.structured_outputs), self.max_grammar_bytes)
        if self.speculative and params.use_beam_search:
            raise InvalidSamplingParam(
                "use_beam_search", "beam search does not combine with speculative decoding "
                "(the engine was started with --speculative-config)")
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.best_of > self.max_num_seqs:
            # best_of defaults to n: name the one the caller set.
            param = "n" if params.best_of == params.n else "best_of"
            raise InvalidSamplingParam(
                param, f"{param}={params.best_of} exceeds the {self.max_num_seqs} sequences "
                "the engine runs at once (max_num_seqs)")
        capacity = self.num_kv_blocks * self.block_size
        needed = self._worst_case_blocks(len(token_ids), max_tokens, params.best_of)
        if needed * self.block_size > capacity:
            raise PromptTooLong(
                "max_tokens",
                f"the request needs up to {needed * self.block_size} tokens of KV cache "
                f"but the whole pool holds {capacity}; lower max_tokens (or n, best_of) or "
                "enlarge the cache")
        # A bad id inside a batched scatter would fail the whole step, so reject it here.
        check_token_ids(params, self.vocab_size)
        check_some_token_allowed(params, self.eos_token_ids)
        check_extra_args(params, self.logits_processors)
        return max_tokens

    def _check_pooling(self, token_ids: list[int], params: PoolingParams) -> int:
        """A pooling request computes its prompt, all of it within the context window."""
        if self.runner != "pooling":
            what = "classification" if params.task == "classify" else "embeddings"
            raise InvalidSamplingParam(
                "prompt", f"this engine generates text; {what} need a pooling model on an "
                "engine started with --runner pooling (runner='pooling')")
        self._check_task(params)
        if not token_ids:
            raise InvalidSamplingParam("prompt", "the prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise PromptTooLong(
                "prompt", f"the prompt has {len(token_ids)} tokens but the model's context "
                f"length is {self.max_model_len}; shorten the prompt")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise InvalidSamplingParam(
                "prompt", f"prompt token ids must be in [0, {self.vocab_size})")
        if params.dimensions is not None:
            self._check_dimensions(params.dimensions)
        if self._worst_case_blocks(len(token_ids), 0, 1) > self.num_kv_blocks:
            raise PromptTooLong(
                "prompt", f"the prompt needs more KV cache than the whole pool holds "
                f"({self.num_kv_blocks * self.block_size} tokens); shorten it or enlarge "
                "the cache")
        return 0

    def _check_task(self, params: PoolingParams) -> None:
        """A classifier classifies and an embedding model embeds (vLLM refuses the others),
        each with its own parameters."""
        task, dimensions = params.task, params.dimensions
        if task == "classify" and not self.num_labels:
            raise InvalidSamplingParam(
                "model", "this model is not a sequence classifier (XForSequenceClassification "
                "with a score head): classification is not supported; it serves embeddings "
                "(/v1/embeddings, LLM.embed)")
        if task == "classify" and dimensions is not None:
            raise InvalidSamplingParam(
                "dimensions", "dimensions cuts an embedding; a classification has none")
        if task == "embed" and self.num_labels:
            raise InvalidSamplingParam(
                "model", "this model is a sequence classifier: it serves classification "
                "(/classify, LLM.classify), and scores and reranking when it has one label "
                "(a cross-encoder); embeddings need an embedding model")
        if task == "embed" and params.use_activation is not None:
            raise InvalidSamplingParam(
                "use_activation", "use_activation is a classifier's (its logits or their "
                "probabilities); an embedding takes normalize")

    def _check_dimensions(self, dimensions: int) -> None:
        """``dimensions`` keeps an embedding's first values (vLLM's Matryoshka rule): only for
        a model trained for it, and one of the sizes its config lists, where it lists them.
        The model's own size is always accepted: nothing is cut."""
        if dimensions == self.hidden_size:
            return
        if not self.is_matryoshka:
            raise InvalidSamplingParam(
                "dimensions", f"dimensions={dimensions}: this model's embeddings have "
                f"{self.hidden_size} values and it is not a Matryoshka model (its config.json "
                "sets neither is_matryoshka nor matryoshka_dimensions), so they cannot be "
                f"shortened; leave dimensions unset or {self.hidden_size}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            sizes = ", ".join(map(str, self.matryoshka_dimensions))
            raise InvalidSamplingParam(
                "dimensions", f"dimensions={dimensions}: this model's Matryoshka sizes are "
                f"{sizes} (matryoshka_dimensions in its config.json)")
        if not 1 <= dimensions <= self.hidden_size:
            raise InvalidSamplingParam(
                "dimensions", f"dimensions={dimensions} must be from 1 to the model's "
                f"{self.hidden_size}")

    def _check_logprobs(self, params: SamplingParams) -> None:
        # Never past the vocabulary, whatever --max-logprobs says: the sampler's top-k is
        # taken over the logits' row.
        limit = self.vocab_size if self.max_logprobs == -1 else min(self.max_logprobs,
                                                                    self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > limit:
                raise InvalidSamplingParam(
                    name, f"{name}={asked} is more than the {limit} this engine returns at "
                    f"most; lower it, or start the engine with a larger --max-logprobs "
                    f"(-1: the vocabulary size, {self.vocab_size})")

    def _worst_case_blocks(self, num_prompt: int, max_tokens: int, num_seqs: int) -> int:
        """Blocks of ``num_seqs`` sequences sharing the prompt and then fully diverging, each
        extra one with its own copy of the prompt's last partial block."""
        extra = -(-max_tokens // self.block_size) + 1
        return -(-(num_prompt + max_tokens) // self.block_size) + (num_seqs - 1) * extra


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int,
                    pooling: bool = False) -> list[int]:
    """The prompt's last ``keep`` tokens (``truncate_prompt_tokens``; -1: as many as leave room
    for one token in the context window, or with ``pooling``, which generates none, as many
    as it holds), or all of them when ``keep`` is None. The API server truncates before it
    checks and counts a prompt; the engine again, which keeps the same."""
    if keep is None:
        return token_ids
    return token_ids[-(max_model_len - (not pooling) if keep == -1 else keep):]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, limits: InputLimits,
                 admit_adapter: Callable[[LoRARequest], str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        # The adapter's content hash, its folder read and checked (``ValueError`` if it cannot be
        # served); None: LoRA is off.
        self.admit_adapter = admit_adapter

    def _lora_key(self, lora_request: LoRARequest | None) -> str | None:
        if lora_request is None:
            return None
        if self.admit_adapter is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name}: LoRA is off; start the "
                             "engine with --enable-lora")
        return self.admit_adapter(lora_request)

    def process(self, request_id: str, prompt: str | list[int],
                params: SamplingParams | PoolingParams,
                lora_request: LoRARequest | None = None, priority: int = 0) -> RequestState:
        """A validated request with its sequences; ``state.group`` goes to the scheduler.
        Raises ``ValueError`` (``PromptTooLong`` among them) for input it cannot run."""
        self.limits.check_priority(priority)
        state = self._process(request_id, prompt, params, lora_request)
        state.group.priority = priority
        return state

    def _process(self, request_id: str, prompt: str | list[int],
                 params: SamplingParams | PoolingParams,
                 lora_request: LoRARequest | None) -> RequestState:
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
        pooling = params if isinstance(params, PoolingParams) else None
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens,
                                    self.limits.max_model_len, pooling is not None)
        if pooling is not None:
            self.limits.check(token_ids, pooling)
            return self._pooling_state(request_id, text, token_ids, pooling, lora_request)
        if params.bad_words_token_ids is not None:  # the engine's own, from bad_words
            raise InvalidSamplingParam(
                "bad_words_token_ids", "bad_words_token_ids is set by the engine from "
                "bad_words, with this engine's tokenizer; pass the words as bad_words")
        if params.bad_words:  # a copy: the caller's params may serve other engines
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_words_token_ids(
                params.bad_words))
        max_tokens = self.limits.check(token_ids, params)
        cache_key = self._lora_key(lora_request)
        beam = self._beam_state(params, max_tokens)
        # Beam search starts from one sequence; parallel sampling forks best_of from the prompt.
        seq_params = _beam_params(params) if beam is not None else params
        seqs = [Sequence(token_ids, seq_params, max_tokens, self.limits.eos_token_ids,
                         seed=None if beam is not None else _seed(params, i),
                         lora_request=lora_request, cache_key=cache_key,
                         long_rope=self.limits.long_rope(token_ids))
                for i in range(1 if beam is not None else params.best_of)]
        group = SequenceGroup(request_id, seqs[:1], width=params.best_of,
                              pending_forks=seqs[1:])
        state = RequestState(request_id, text, token_ids, params,
                             RequestMetrics(arrival_time=time.time()), group, beam=beam)
        state.seqs = [self._sequence_state(state, seq, i) for i, seq in enumerate(seqs)]
        return state

    def _pooling_state(self, request_id: str, text: str | None, token_ids: list[int],
                       pooling: PoolingParams, lora_request: LoRARequest | None
                       ) -> RequestState:
        """One stream that computes its prompt and samples nothing; its output is the pooled
        vector (``RequestOutput.embedding``), once, when it finishes."""
        seq = Sequence(token_ids, POOLING_SAMPLING, 0, lora_request=lora_request,
                       cache_key=self._lora_key(lora_request), pooling=pooling,
                       long_rope=self.limits.long_rope(token_ids))
        state = RequestState(request_id, text, token_ids, POOLING_SAMPLING,
                             RequestMetrics(arrival_time=time.time()),
                             SequenceGroup(request_id, [seq]))
        state.seqs = [self._sequence_state(state, seq, 0)]
        return state

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as typed and after a space, as vLLM tokenizes them: mid-text, most
        tokenizers fold the space into the word's first token. The spaced form is kept only
        where it is that: as long as the plain one, from another first token (otherwise it is
        the plain form behind a token of its own, and bans nothing more)."""
        found = []
        for word in words:
            plain, spaced = (self.tokenizer.encode(text, add_special_tokens=False)
                             for text in (word.lstrip(), " " + word.lstrip()))
            found.append(plain)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                found.append(spaced)
        return found

    def _sequence_state(self, state: RequestState, seq: Sequence, index: int) -> SequenceState:
        if state.beam is not None:
            return SequenceState(index, seq, state, None, None)
        params = state.params
        return SequenceState(
            index, seq, state,
            detokenizer=IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, params),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.needs_logprobs else None)

    def _beam_state(self, params: SamplingParams, max_tokens: int) -> BeamState | None:
        if not params.use_beam_search:
            return None
        stops = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.limits.eos_token_ids
        return BeamState(BeamSearch(params.best_of, max_tokens, stops, params.length_penalty,
                                    params.early_stopping))


# What the engine's stages read of a pooling request's stream: nothing to sample or decode,
# one output when it finishes.
POOLING_SAMPLING = SamplingParams(max_tokens=0, detokenize=False, output_kind="final_only")


def _seed(params: SamplingParams, index: int) -> int | None:
    """The seed of stream ``index`` of a request, None when the request is unseeded."""
    return None if params.seed is None else stream_seed(params.seed, index)


def _beam_params(params: SamplingParams) -> SamplingParams:
    """Beams are scored from their logprobs, so their rows sample greedily and cheaply."""
    return dataclasses.replace(params, temperature=0.0, logprobs=None)
