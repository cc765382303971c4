"""Pooling (embedding) settings, named as in vLLM: the engine's ``pooler_config`` (how every
request of a ``--runner pooling`` engine is pooled) and a request's ``PoolingParams``.

An embedding is the model's final hidden state (after the final norm) pooled over the prompt:
``LAST`` takes the last token's row (decoder embedding models: Qwen3-Embedding, gte-Qwen2,
e5-mistral), ``MEAN`` the mean of every row, ``CLS`` the first row; then, with ``normalize``,
divided by its L2 norm.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from pagedserve.errors import ConfigError
from pagedserve.field_types import plain_fields, wrong_type
from pagedserve.sampling_params import InvalidSamplingParam

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
POOLING_TASKS = ("embed", "classify")
# A sentence-transformers Pooling module's flags (its ``config.json``) -> our pooling type;
# its other modes (max, mean_sqrt_len_tokens, weightedmean) have no counterpart here.
SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST",
                               "pooling_mode_mean_tokens": "MEAN",
                               "pooling_mode_cls_token": "CLS"}
_FLAG = "--pooler-config"


@dataclass(frozen=True)
class PoolerConfig:
    """``--pooler-config`` / ``LLM(pooler_config={...})``: vLLM's ``pooling_type`` and
    ``normalize``. A field left None takes the checkpoint's default (``with_defaults``): its
    sentence-transformers modules where it has them, else vLLM's for a decoder model's
    embeddings, LAST and normalized."""

    pooling_type: str | None = None
    normalize: bool | None = None

    @classmethod
    def parse(cls, value: PoolerConfig | dict[str, Any] | str) -> PoolerConfig:
        """From the Python API's dict or the command line's JSON text."""
        if isinstance(value, PoolerConfig):
            return value
        fields = json_object(value, _FLAG, {f.name for f in dataclasses.fields(cls)})
        if isinstance(fields.get("pooling_type"), str):
            fields["pooling_type"] = fields["pooling_type"].upper()
        return cls(**fields)

    def __post_init__(self) -> None:
        wrong = wrong_type(self, _CONFIG_FIELDS)
        if wrong is not None:
            raise ConfigError(f"{_FLAG}: {wrong[0]} {wrong[1]}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"{_FLAG}: pooling_type must be one of "
                              f"{', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    @property
    def reads_every_token(self) -> bool:
        """Whether the pooled vector needs hidden states of prompt tokens other than the last
        (MEAN, CLS): a prefix served from the cache never had them computed."""
        return self.pooling_type not in (None, "LAST")

    def with_defaults(self, model: PoolerConfig | None = None) -> PoolerConfig:
        """Every field set: this config's (the user's), else ``model``'s (the checkpoint's
        sentence-transformers defaults), else LAST and normalized."""
        model = model or PoolerConfig()
        pooling_type = self.pooling_type or model.pooling_type or "LAST"
        normalize = next((v for v in (self.normalize, model.normalize) if v is not None), True)
        return PoolerConfig(pooling_type, normalize)

    @classmethod
    def from_sentence_transformers(cls, modes: tuple[str, ...], normalize: bool
                                   ) -> PoolerConfig:
        """A checkpoint's defaults as vLLM reads them from its sentence-transformers modules:
        the Pooling module's one true ``pooling_mode_*`` flag (None where it has none, or
        several, or one we cannot run), and normalization iff ``modules.json`` lists a
        Normalize module."""
        kinds = [SENTENCE_TRANSFORMERS_MODES.get(m) for m in modes]
        return cls(kinds[0] if len(kinds) == 1 else None, normalize)


def json_object(value: Any, flag: str, known: set[str]) -> dict[str, Any]:
    """A structured option's fields, from a dict or its JSON text; ``ConfigError`` naming
    ``flag`` for text that is not a JSON object or for a field not in ``known``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(map(str, set(value) - known))
    if unknown:
        raise ConfigError(f"{flag}: unknown field(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(known))}")
    return dict(value)


@dataclass
class PoolingParams:
    """One pooling request's settings (vLLM's names). ``normalize`` None takes the
    engine's ``pooler_config``; ``dimensions`` keeps the embedding's first values, then
    normalizes them (Matryoshka models only: the engine checks it against the model's
    ``is_matryoshka`` / ``matryoshka_dimensions``); ``truncate_prompt_tokens`` keeps the
    prompt's last k tokens (-1: as many as the context holds). ``use_activation`` (classify
    only) false returns a classifier's raw logits instead of its probabilities; None or true
    applies the model's activation (``ModelArchConfig.classifier_activation``)."""

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's current name; its older ``activation`` and ``softmax`` were removed in v0.15.
    use_activation: bool | None = None
    # vLLM's pooling task: "embed" (LLM.embed, /v1/embeddings) or "classify" (LLM.classify,
    # /classify); the engine serves the one its model has the head for.
    task: str = "embed"

    def __post_init__(self) -> None:
        wrong = wrong_type(self, _PARAMS_FIELDS)
        if wrong is not None:
            raise InvalidSamplingParam(wrong[0], f"{wrong[0]} {wrong[1]}")
        if self.task not in POOLING_TASKS:
            raise InvalidSamplingParam("task", f"task must be one of {', '.join(POOLING_TASKS)}"
                                       f", got {self.task!r:.40}")
        keep = self.truncate_prompt_tokens
        if keep is not None and keep < 1 and keep != -1:
            raise InvalidSamplingParam(
                "truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or at least 1, "
                f"got {keep}")


_CONFIG_FIELDS = plain_fields(PoolerConfig)
_PARAMS_FIELDS = plain_fields(PoolingParams)
