"""Owns the model weights and the KV cache on one device, and runs one step of the model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.engine.input_batch import build_inputs
from pagedserve.logger import get_logger
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.registry import model_class
from pagedserve.platforms.interface import Platform
from pagedserve.sample.metadata import SamplingMetadata
from pagedserve.sample.sampler import Sampler, SamplerOutput, prompt_logprobs

logger = get_logger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    dtype: torch.dtype

    def bytes_per_block(self, arch: ModelArchConfig) -> int:
        return (arch.kv_bytes_per_token_per_dtype_byte * self.block_size
                * torch.empty(0, dtype=self.dtype).element_size())


class PromptLogprobsChunk(NamedTuple):
    """Logprobs of prompt tokens ``first_position+1 ...`` computed in this step's chunk."""

    first_position: int
    result: tuple  # sampler.prompt_logprobs output


class StepResult(NamedTuple):
    sampled_request_ids: list[str]
    sampler_output: SamplerOutput | None
    prompt_logprobs: dict[str, PromptLogprobsChunk]


class ModelRunner:
    def __init__(self, platform: type[Platform], arch: ModelArchConfig, dtype: torch.dtype,
                 max_model_len: int) -> None:
        self.platform = platform
        self.arch = arch
        self.dtype = dtype
        self.device = platform.device()
        backend_cls = platform.attention_backend()
        backend = backend_cls(arch.num_heads, arch.head_dim, arch.num_kv_heads,
                              arch.head_dim ** -0.5)
        with torch.device(self.device):
            model = model_class(arch.architecture)(arch, backend, max_model_len)
        self.model = model.to(dtype=dtype).eval()
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 16

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(weights)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def allocate_kv_cache(self, spec: KVCacheSpec) -> None:
        """One tensor ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` so block copies and
        swaps move every layer at once; each layer attends over its own view."""
        a = self.arch
        self.block_size = spec.block_size
        self.kv_cache = self.platform.allocate_kv_cache(
            (a.num_layers, 2, spec.num_blocks, spec.block_size, a.num_kv_heads, a.head_dim),
            spec.dtype)
        self.kv_caches = list(self.kv_cache.unbind(0))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sampling: SamplingMetadata | None) -> StepResult:
        inputs = build_inputs(out, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        sampled_ids = [s.request.request_id for s in out.scheduled if s.samples]
        sampler_output = None
        if sampled_ids:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            sampler_output = self.sampler(logits.float(), sampling)
        return StepResult(sampled_ids, sampler_output,
                          self._prompt_logprobs(out, hidden))

    def _prompt_logprobs(self, out: SchedulerOutput,
                         hidden: torch.Tensor) -> dict[str, PromptLogprobsChunk]:
        results = {}
        row = 0
        for item in out.scheduled:
            request, start, n = item.request, item.num_computed_tokens, item.num_new_tokens
            k = request.params.prompt_logprobs
            # Rows whose next token is still a prompt token (not after a preemption restart).
            last = min(start + n, request.num_prompt_tokens - 1)
            if k is not None and request.num_preemptions == 0 and last > start:
                rows = hidden[row:row + last - start]
                targets = torch.tensor(request.prompt_token_ids[start + 1:last + 1],
                                       device=hidden.device)
                logits = self.model.compute_logits(rows).float()
                results[request.request_id] = PromptLogprobsChunk(
                    start, prompt_logprobs(logits, targets, k))
            row += n
        return results
