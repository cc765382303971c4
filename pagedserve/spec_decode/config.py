"""``speculative_config``: vLLM's fields, parsed and checked once.

``LLM(speculative_config={...})`` and ``--speculative-config '<json>'`` take the same keys as
vLLM's: ``method`` (``ngram``, ``draft_model``, ``eagle3``), ``num_speculative_tokens``,
``prompt_lookup_max`` / ``prompt_lookup_min`` (n-gram), ``model`` (the draft checkpoint or
the EAGLE-3 head) and ``draft_tensor_parallel_size``. As in vLLM, a missing ``method`` is
inferred from ``model``: ``"ngram"`` / ``"[ngram]"`` name the n-gram proposer, a folder whose
config names an EAGLE-3 head ``eagle3``, anything else a draft checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedserve.errors import ConfigError
from pagedserve.field_types import plain_fields, wrong_type
from pagedserve.pooling_params import json_object
from pagedserve.user_paths import expand_user

SPEC_METHODS = ("ngram", "draft_model", "eagle3")
# The methods whose drafts rank 0 draws on the device, inside the verify step.
DEVICE_METHODS = ("draft_model", "eagle3")
_FLAG = "--speculative-config"
# Without either bound: match suffixes of 2 to 5 tokens (longest first).
_DEFAULT_LOOKUP = (2, 5)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From the Python API's dict or the command line's JSON text."""
        if isinstance(value, SpeculativeConfig):
            return value
        fields = json_object(value, _FLAG, {f.name for f in dataclasses.fields(cls)})
        if fields.get("method") is None:
            fields["method"] = _inferred_method(fields.get("model"))
        if "num_speculative_tokens" not in fields:
            raise ConfigError(f"{_FLAG}: num_speculative_tokens is required")
        return cls(**fields)

    def __post_init__(self) -> None:
        # The JSON's values come as they are: a string where a count goes failed a comparison
        # with a TypeError, a float bound reached the n-gram matcher.
        wrong = wrong_type(self, _PLAIN_FIELDS)
        if wrong is not None:
            raise ConfigError(f"{_FLAG}: {wrong[0]} {wrong[1]}")
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"{_FLAG}: method must be one of {', '.join(SPEC_METHODS)}, "
                              f"got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"{_FLAG}: num_speculative_tokens must be an integer of at least "
                              f"1, got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            self._resolve_lookup()
        elif self.model is None:
            raise ConfigError(f"{_FLAG}: method {self.method} needs model (the draft "
                              "checkpoint or the EAGLE-3 head)")
        if self.draft_tensor_parallel_size is not None and self.draft_tensor_parallel_size != 1:
            # The draft runs on rank 0 alone, whatever the target's tensor parallelism.
            raise ConfigError(f"{_FLAG}: draft_tensor_parallel_size "
                              f"{self.draft_tensor_parallel_size} is not built; the draft "
                              "model runs on one device (1)")

    def _resolve_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low, high = _DEFAULT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        if low < 1 or high < low:
            raise ConfigError(f"{_FLAG}: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{low} and {high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)


_PLAIN_FIELDS = plain_fields(SpeculativeConfig)


def _inferred_method(model: str | None) -> str:
    if model is None:
        raise ConfigError(f"{_FLAG}: give method ({', '.join(SPEC_METHODS)}) or model")
    if model in ("ngram", "[ngram]"):
        return "ngram"
    if not isinstance(model, str):
        return "draft_model"  # whose check says what model must be
    from pagedserve.models.eagle3 import is_eagle3_folder

    return "eagle3" if is_eagle3_folder(expand_user(model)) else "draft_model"
