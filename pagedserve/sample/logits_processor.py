"""Custom logits processors (``--logits-processors``): user classes that edit each step's logits.

The contract, which ``worker/sampling_batch.py`` keeps:

- Each rank constructs every processor once, ``cls(config, device)``, when its runner is made
  (only rank 0 samples, so only rank 0's see requests).
- ``add(row, params)`` when a sequence gets a row of the persistent sampling batch; it returns
  whether the processor edits that row, so a step none of whose rows it edits skips it.
  ``remove(row)`` when the row is taken back (a finished sequence's row, reclaimed lazily, so
  a processor may keep a finished row's state a while). Rows are stable: a sequence keeps its
  row while it lives (preemptions included), so there is no "moved".
- ``apply(logits, rows)`` once per step: ``logits`` is float32 [P, V], a row per sample
  position in the step's order, and ``rows`` (int64 [P], on the device) the batch row of each.
  A processor keeps its per-row state in device tensors indexed by batch row and gathers with
  ``rows``: one tensor op a step, no Python per request. It may edit ``logits`` in place (they
  are the sampler's own copy) and returns the result.
- ``is_argmax_invariant()``: True if it can never change a row's argmax (a monotone rescaling,
  a mask that spares the largest logit). Such a processor only shapes what random rows draw
  from: it runs just before temperature, on a copy, and greedy rows and logprobs never see it.
  The others run with the built-in processing, so greedy tokens and logprobs include them.
- ``validate_params(params)`` (a classmethod) raises ``ValueError`` for a request this
  processor cannot serve, usually for its ``params.extra_args``; the engine calls it when it
  admits the request, so a bad one is refused (an API 400 naming ``vllm_xargs``) and never
  fails a step.

Entries of ``--logits-processors`` are qualified names, ``package.module:Class`` or
``package.module.Class``; the Python API also takes the classes themselves.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, NamedTuple

import torch

from pagedserve.errors import ConfigError
from pagedserve.sampling_params import InvalidSamplingParam, SamplingParams

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig


class LogitsProcessor(ABC):
    """Subclass this; the module doc states when each method is called."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        """Called once per rank, with the engine's options and the rank's device."""
        self.device = device

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ``ValueError`` if this processor cannot serve a request with ``params``; by
        default it serves every request."""
        return None

    @abstractmethod
    def is_argmax_invariant(self) -> bool: ...

    @abstractmethod
    def add(self, row: int, params: SamplingParams) -> bool: ...

    @abstractmethod
    def remove(self, row: int) -> None: ...

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor: ...


class StepProcessors(NamedTuple):
    """The processors one step runs: only those that edit at least one of its rows."""

    changing: list[LogitsProcessor]  # may change the argmax: run with the built-in processing
    invariant: list[LogitsProcessor]  # argmax-invariant: run before temperature, random rows
    rows: torch.Tensor  # int64 [P]: the batch row of each logits row


def apply_processors(logits: torch.Tensor, processors: list[LogitsProcessor],
                     rows: torch.Tensor) -> torch.Tensor:
    for processor in processors:
        logits = processor.apply(logits, rows)
    return logits


def load_logits_processors(entries: Sequence[str | type] | None
                           ) -> tuple[type[LogitsProcessor], ...]:
    """The classes of ``--logits-processors``; an entry that does not import, or is not a
    ``LogitsProcessor``, is a ``ConfigError`` naming the option. None is none (vLLM's
    default)."""
    if entries is None:
        return ()
    if isinstance(entries, str) or not isinstance(entries, (list, tuple)):
        raise ConfigError(f"--logits-processors must be a list of qualified class names or "
                          f"classes, got {entries!r:.80}")
    return tuple(_load(entry) for entry in entries)


def qualified_name(cls: type) -> str:
    """``package.module:Class``, which ``processor_class`` imports back."""
    return f"{cls.__module__}:{cls.__qualname__}"


@cache
def processor_class(name: str) -> type[LogitsProcessor]:
    """The class a qualified name stands for, imported once per process."""
    return _load(name)


def check_extra_args(params: SamplingParams, processors: Sequence[str]) -> None:
    """Let each processor (by qualified name) refuse the request; a refusal is an
    ``InvalidSamplingParam`` of ``extra_args``."""
    for name in processors:
        try:
            processor_class(name).validate_params(params)
        except ValueError as exc:
            raise InvalidSamplingParam("extra_args", str(exc)) from None


def _load(entry: str | type) -> type[LogitsProcessor]:
    cls = _import(entry) if isinstance(entry, str) else entry
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        shown = entry if isinstance(entry, str) else repr(entry)
        raise ConfigError(f"--logits-processors {shown:.80} is not a subclass of "
                          "pagedserve.sample.logits_processor.LogitsProcessor")
    return cls


def _import(name: str) -> object:
    module_name, _, attribute = name.partition(":") if ":" in name else name.rpartition(".")
    try:
        found: object = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError, ValueError) as exc:
        # The console script does not put the working folder on sys.path, as `python` does.
        hint = ("; install its package, or put its folder on PYTHONPATH"
                if isinstance(exc, ModuleNotFoundError) else "")
        raise ConfigError(f"--logits-processors {name}: cannot import it ({exc}){hint}") from None
    return found
