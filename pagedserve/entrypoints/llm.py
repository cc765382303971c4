"""The offline API, named as in vLLM: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pagedserve.config import OPTION_NAMES, EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.lora.request import LoRARequest
from pagedserve.models.chat_template import read_chat_template, render_options
from pagedserve.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.scoring import cosine_similarity, cross_encoder_prompts, score_pairs

if TYPE_CHECKING:
    import torch

# A prompt: text, token ids, or vLLM's dict forms ({"prompt": text}, {"prompt_token_ids": ids}).
Prompt = str | list[int] | dict[str, Any]
ChatMessages = list[dict[str, Any]]
_PROMPT_FORMS = ("a str, a list of token ids, {'prompt': str} or "
                 "{'prompt_token_ids': list[int]}")


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        """``options`` are ``EngineConfig``'s fields: the engine flags, with underscores."""
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"LLM() got unknown option(s) {', '.join(unknown)}; valid options: "
                            f"{', '.join(OPTION_NAMES)}")
        self.engine = LLMEngine(EngineConfig(model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (processes or Ray actors, and the Ray
        connection the engine opened) and leave their process group, so that another engine
        can start in this process. Idempotent; leaving a ``with LLM(...)`` block, or dropping
        the last reference to the LLM, does the same."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ---- between RL training steps: vLLM's calls ----------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (after new weights); False, and nothing done,
        while requests are in flight."""
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the device (needs ``enable_sleep_mode=True``): level 1 moves the weights to
        host memory, level 2 discards them; both free the KV cache (its contents are lost).
        No request may be added until ``wake_up``."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both). After level 2 the
        weights come back uninitialised: ``load_weights`` before generating."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (name, tensor) pairs under the checkpoint's (Hugging Face) names into the
        model on every tensor-parallel rank, each keeping its slice (a whole checkpoint, as a
        trainer's ``state_dict().items()`` gives), and reset the prefix cache."""
        self.engine.load_weights(weights)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no ``sampling_params``: the
        model's generation_config.json defaults under ``generation_config="auto"`` (vLLM's
        name and rule), else SamplingParams' own."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs keep input order.
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt.
        ``priority``: one int per prompt, lower served earlier (vLLM's; needs
        ``scheduling_policy="priority"``)."""
        _check_use_tqdm(use_tqdm)
        prompt_list = _as_prompt_list(prompts)
        loras = _per_prompt(lora_request, len(prompt_list))
        priorities = None if priority is None else _priorities(priority, len(prompt_list))
        params_list = _per_prompt_params(sampling_params, SamplingParams, len(prompt_list),
                                         self.get_default_sampling_params(), "sampling_params")
        # Offline callers only read finished outputs; skip building the intermediate ones.
        params_list = [dataclasses.replace(sp, output_kind="final_only") for sp in params_list]
        return self._run(self.engine.add_requests(prompt_list, params_list, loras, priorities),
                         use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (vLLM's call), in input order; the engine must have been
        made with ``runner="pooling"`` (``pooler_config`` says how it pools).
        ``truncate_prompt_tokens`` keeps each prompt's last k tokens (-1: as many as the
        context holds), where ``pooling_params`` leave it unset. ``priority`` as
        ``generate``'s."""
        outputs = self._pool(prompts, "embed", truncate_prompt_tokens, use_tqdm,
                             pooling_params, lora_request, priority)
        return [EmbeddingRequestOutput.of(o) for o in outputs]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities (vLLM's call), in input order, from a sequence
        classifier (``XForSequenceClassification``, ``runner="pooling"``): its score head over
        the prompt's last token, then softmax (sigmoid for one label); the raw logits where
        ``pooling_params`` say ``use_activation=False``. Arguments as ``embed``'s."""
        outputs = self._pool(prompts, "classify", truncate_prompt_tokens, use_tqdm,
                             pooling_params, lora_request, priority)
        return [ClassificationRequestOutput.of(o) for o in outputs]

    def _pool(self, prompts, task: str, truncate_prompt_tokens: int | None, use_tqdm,
              pooling_params, lora_request, priority) -> list[RequestOutput]:
        """``embed``'s and ``classify``'s run: every prompt as a pooling request of ``task``."""
        _check_use_tqdm(use_tqdm)
        prompt_list = _as_prompt_list(prompts)
        params_list = _per_prompt_params(pooling_params, PoolingParams, len(prompt_list),
                                         PoolingParams(), "pooling_params")
        params_list = [dataclasses.replace(p, task=task, truncate_prompt_tokens=(
            truncate_prompt_tokens if p.truncate_prompt_tokens is None
            else p.truncate_prompt_tokens)) for p in params_list]
        loras = _per_prompt(lora_request, len(prompt_list))
        priorities = None if priority is None else _priorities(priority, len(prompt_list))
        return self._run(self.engine.add_requests(prompt_list, params_list, loras, priorities),
                         use_tqdm)

    def score(
        self,
        data_1: Prompt | Sequence[Prompt],
        data_2: Prompt | Sequence[Prompt],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's call for an embedding model (``runner="pooling"``): the cosine similarity of
        ``data_1``'s embedding with each of ``data_2``'s (1:N), or of the i-th with the i-th
        when both are lists of one length (N:N); one output per pair, in order. Every text is
        embedded once, all in one batch, as ``embed`` would. With a cross-encoder (a sequence
        classifier of one label) each pair of texts is one prompt, the tokenizer's pair
        encoding, and its score the classifier's probability (its raw logit with
        ``PoolingParams(use_activation=False)``), as vLLM's."""
        firsts, seconds = _as_prompt_list(data_1), _as_prompt_list(data_2)
        pairs = score_pairs(len(firsts), len(seconds))
        if self.engine.arch.num_labels == 1:
            return self._cross_encoder_scores(firsts, seconds, pairs, truncate_prompt_tokens,
                                              use_tqdm, pooling_params, lora_request)
        embedded = self.embed(firsts + seconds, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, pooling_params=pooling_params,
                              lora_request=lora_request)
        return [_scored(embedded[i], embedded[len(firsts) + j]) for i, j in pairs]

    def _cross_encoder_scores(self, firsts, seconds, pairs, truncate_prompt_tokens, use_tqdm,
                              pooling_params, lora_request) -> list[ScoringRequestOutput]:
        """A one-label classifier's scores: each pair classified as one prompt."""
        if not all(isinstance(t, str) for t in firsts + seconds):
            raise TypeError("scoring with a cross-encoder (a classifier of one label) takes "
                            "texts, which its tokenizer joins as a pair")
        prompts = cross_encoder_prompts(self.engine.tokenizer, firsts, seconds, pairs)
        outputs = self.classify(prompts, truncate_prompt_tokens=truncate_prompt_tokens,
                                use_tqdm=use_tqdm, pooling_params=pooling_params,
                                lora_request=lora_request)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]),
                                     o.prompt_token_ids) for o in outputs]

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search call; the beams are HF transformers' (``generate(num_beams=)``,
        token for token). Each output lists all ``beam_width`` finished beams, best first."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {params!r:.80}")
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm, lora_request)
        return [BeamSearchOutput([
            BeamSearchSequence(out.prompt_token_ids + beam.token_ids, beam.text,
                               beam.cumulative_logprob, beam.finish_reason, beam.stop_reason)
            for beam in out.outputs]) for out in outputs]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation, then generate. The first four
        arguments are vLLM's, in its order; the rest are keyword-only. ``chat_template`` (its
        text, or a file as ``--chat-template`` takes) replaces the engine's for this call;
        ``chat_template_kwargs`` are more variables for the template (``enable_thinking``).
        ``tools`` (OpenAI's form, ``{"type": "function", "function": {...}}``) go to the
        template, which describes them to the model as its family expects; messages may hold
        ``role: tool`` results and assistant ``tool_calls``. ``continue_final_message`` (with
        ``add_generation_prompt=False``) ends the prompt with the last message's text, so the
        model continues that turn."""
        conversations = _conversations(messages)
        options = dict(render_options(add_generation_prompt, continue_final_message,
                                      chat_template_kwargs),
                       chat_template=self._chat_template(chat_template), tools=tools)
        tokenizer = self.engine.tokenizer
        # The template already holds any BOS token; tokenize without adding another.
        token_lists = [
            tokenizer.encode(tokenizer.apply_chat_template(
                _template_messages(conv), tokenize=False, **options), add_special_tokens=False)
            for conv in conversations
        ]
        return self.generate(token_lists, sampling_params, use_tqdm, lora_request)

    def _chat_template(self, chat_template: Any) -> str | None:
        """The text of the call's template, or None for the engine's (which must exist)."""
        if chat_template is None:
            if self.engine.tokenizer.chat_template is None:
                raise ValueError(f"LLM.chat: the model {self.engine.model_name} has no chat "
                                 "template; pass chat_template=, or use LLM.generate with "
                                 "the prompt text")
            return None
        if not isinstance(chat_template, str):
            raise TypeError("chat_template must be a Jinja template's text or its file, got "
                            f"{chat_template!r:.80}")
        return read_chat_template(chat_template, name="chat_template")

    def _run(self, request_ids: list[str],
             use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        """Step until every request has finished; any exception on the way (a failed step,
        a KeyboardInterrupt) aborts the batch, so the engine is left with none of it."""
        finished: dict[str, RequestOutput] = {}
        bar = None
        try:
            bar = _progress_bar(use_tqdm, len(request_ids))
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in request_ids]


def _per_prompt_params(params: Any, kind: type, num_prompts: int, default: Any,
                       name: str) -> list:
    """One params object for every prompt (``default`` where none is given), or one each."""
    if params is None or isinstance(params, kind):
        return [default if params is None else params] * num_prompts
    params_list = _list_of(params, kind, name)
    if len(params_list) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(params_list)} "
                         f"{name.replace('_', ' ')}")
    return params_list


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = _list_of(lora_request, (LoRARequest, type(None)), "lora_request")
    if len(loras) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(loras)} LoRA requests")
    return loras


def _priorities(priority: Sequence[int], num_prompts: int) -> list[int]:
    priorities = _list_of(priority, int, "priority")
    if len(priorities) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(priorities)} priorities")
    return priorities


def _list_of(values: Any, kind: type | tuple[type, ...], name: str) -> list:
    """``values`` (a list or tuple) as a list, each of ``kind``; else a TypeError naming
    ``name``."""
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, kind) for v in values):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise TypeError(f"{name} must be one or a list of "
                        f"{' or '.join(k.__name__ for k in kinds)}, got {values!r:.80}")
    return list(values)


def _scored(first: EmbeddingRequestOutput, second: EmbeddingRequestOutput
            ) -> ScoringRequestOutput:
    return ScoringRequestOutput(
        f"{first.request_id}_{second.request_id}",
        ScoringOutput(cosine_similarity(first.outputs.embedding, second.outputs.embedding)),
        first.prompt_token_ids + second.prompt_token_ids)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """One prompt or a list of them, each as text or token ids."""
    if isinstance(prompts, (str, dict)):
        return [_prompt(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be {_PROMPT_FORMS}, or a list of them; got "
                        f"{prompts!r:.80}")
    if prompts and _is_token_id(prompts[0]):
        return [_prompt(list(prompts))]  # one prompt given as token ids
    return [_prompt(p) for p in prompts]


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, dict):
        prompt = _dict_prompt(prompt)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and all(_is_token_id(t) for t in prompt):
        return [int(t) for t in prompt]  # numpy's integers as Python's
    raise TypeError(f"a prompt must be {_PROMPT_FORMS}; got {prompt!r:.80}")


def _conversations(messages: Any) -> list[ChatMessages]:
    conversations = [messages] if messages and isinstance(messages[0], dict) else messages
    if not isinstance(conversations, list) or not all(isinstance(c, list)
                                                      for c in conversations):
        raise TypeError("messages must be a list of message dicts, or a list of such lists; "
                        f"got {messages!r:.80}")
    return conversations


def _dict_prompt(prompt: dict) -> Any:
    """The text or ids of vLLM's TextPrompt or TokensPrompt; a key of theirs that pagedserve
    does not implement (multi_modal_data, cache_salt, ...) is named."""
    other = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids"}))
    if other:
        raise TypeError(f"prompt key {other[0]!r} is not supported; a prompt dict holds "
                        "'prompt' (text) or 'prompt_token_ids'")
    if len(prompt) != 1:
        raise TypeError(f"a prompt dict holds one of 'prompt' or 'prompt_token_ids', got "
                        f"{prompt!r:.80}")
    return next(iter(prompt.values()))


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _template_messages(messages: ChatMessages) -> ChatMessages:
    """``messages`` for the chat template: OpenAI's content parts joined into text (as the
    server joins them), and a clear error for a message the template could not read."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a 'role', got {message!r:.80}")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise ValueError(f"messages[{i}]: content parts must be "
                                 "{'type': 'text', 'text': str}")
            message = {**message, "content": "\n".join(p["text"] for p in content)}
        elif content is None and not message.get("tool_calls"):
            raise ValueError(f"messages[{i}] has no content")
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}]: content must be a str or a list of text parts")
        out.append(message)
    return out


def _check_use_tqdm(use_tqdm: Any) -> None:
    if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
        raise TypeError("use_tqdm must be a bool or a tqdm-like callable (vLLM's forms), got "
                        f"{use_tqdm!r:.80}")


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int):
    """The batch's bar: none when off, or for a single request unless the caller gave a
    class (or factory) of its own, which is called as tqdm is."""
    if use_tqdm is False or (use_tqdm is True and total < 2):
        return None
    if use_tqdm is True:
        from tqdm import tqdm as use_tqdm
    return use_tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
