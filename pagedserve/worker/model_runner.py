"""Owns the model weights and the KV pool (``kv_cache.KVCache``) on one device, and runs one
step of the model.

Under tensor parallelism there is one runner per rank, each holding its slice of the weights
and of the KV heads. Rank 0's runner (the driver's) plans a step (``plan``: the packed inputs,
as plain data every rank can read) and runs it (``forward``, then ``sample``; driven through
``step_api.StepAPI``); the other ranks run the same step (``follow``) so that every collective
inside the forward pass has all its ranks. Only rank 0 samples: the sampler's state
(``sampling_batch``: each row's settings and generator, kept across steps) lives in the
driver, so gathering the logits to rank 0 moves less than keeping that state identical on
every rank; rank 0 then broadcasts the sampled tokens, which the other ranks need as inputs
under async scheduling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedserve.core.sequence import Sequence
from pagedserve.distributed import TensorParallel, split_heads
from pagedserve.logger import get_logger
from pagedserve.lora.slots import LoRASlots, add_lora_layers
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.linear import LinearFactory
from pagedserve.models.registry import model_class
from pagedserve.platforms.interface import GraphRunner, Platform
from pagedserve.quant.weights import LoadedWeight
from pagedserve.sample.metadata import SamplingMetadata
from pagedserve.sample.sampler import Sampler, SamplerOutput, prompt_logprobs
from pagedserve.worker.input_batch import (
    HostInputs,
    ModelInputs,
    pack_inputs,
)
from pagedserve.worker.kv_cache import KVCache, KVCacheSpec
from pagedserve.worker.sampling_batch import SamplingBatch
from pagedserve.worker.shape_buckets import ShapeBuckets
from pagedserve.worker.step import (
    Forward,
    InFlightTokens,
    PromptLogprobsChunk,
    SamplingInputs,
    StepResult,
)

logger = get_logger(__name__)


class PromptSpan(NamedTuple):
    """Hidden rows ``[row, row + count)`` whose logits score prompt tokens of ``seq`` from
    position ``first_position + 1`` on."""

    seq: Sequence
    first_position: int
    row: int
    count: int


@dataclass
class StepInput:
    """What every rank runs for one step: plain data, the same on all ranks."""

    block_ops: BlockOps
    inputs: HostInputs | None  # None: only block moves (nothing scheduled)
    prompt_rows: list[tuple[int, int]]  # (row, count) of each PromptSpan, in order


class ModelRunner:
    def __init__(self, platform: type[Platform], arch: ModelArchConfig, dtype: torch.dtype,
                 max_model_len: int, kv_cache_dtype: str = "auto",
                 quantizer: Callable[[torch.Tensor], LoadedWeight] | None = None,
                 buckets: ShapeBuckets | None = None,
                 tp: TensorParallel = TensorParallel()) -> None:
        self.platform = platform
        self.arch = arch
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.tp = tp
        self.device = platform.device()
        self.kv_dtype = platform.kv_cache_torch_dtype(kv_cache_dtype, dtype)
        heads = split_heads(arch.num_heads, arch.num_kv_heads, tp)
        self.num_kv_heads = heads.num_kv_heads
        backend_cls = platform.attention_backend()
        backend = backend_cls(heads.num_heads, arch.head_dim, heads.num_kv_heads,
                              arch.head_dim ** -0.5, kv_cache_dtype=kv_cache_dtype)
        linears = LinearFactory(platform, dtype, self.device, quantizer, tp)
        with torch.device(self.device):
            model = model_class(arch.architecture)(arch, backend, max_model_len,
                                                    platform.layer_ops(), linears)
        self.model = model.to(dtype=dtype).eval()
        self.sampler = Sampler()
        self.sampling = SamplingBatch(arch.vocab_size, self.device)  # used by rank 0 alone
        self.kv_cache: KVCache | None = None
        self.block_size = 16
        self.graphs: GraphRunner | None = None
        self._last_tokens: torch.Tensor | None = None  # ranks > 0: the last step's samples
        self.buckets = buckets  # pad every step to these shapes (shape_buckets.py)
        self.pad_block = 0  # with buckets: the pool's last block, written by padded rows only
        self.lora: LoRASlots | None = None  # with --enable-lora: the adapters' device slots

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        self.model.load_weights(weights)

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights of the checkpoint's shapes, generated on the device and loaded like
        a checkpoint's: norms at 1, the rest small normal values so activations stay in range
        at any depth."""
        generator = torch.Generator(device=self.device).manual_seed(seed)

        def tensors():
            for name, shape in self.model.checkpoint_shapes().items():
                if "norm" in name:
                    yield name, torch.ones(shape, dtype=self.dtype, device=self.device)
                else:
                    yield name, torch.empty(shape, dtype=self.dtype, device=self.device).normal_(
                        0.0, 0.02, generator=generator)

        self.load_weights(tensors())

    def add_lora(self, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        """Wrap the loaded model's projections in LoRA layers of ``max_loras`` slots."""
        self.lora = add_lora_layers(self.model, self.platform.lora_ops(), max_loras, max_rank,
                                    max_cpu_loras)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def weight_bytes_read_per_token_step(self) -> int:
        """Weight bytes a decode step reads: every parameter except the input embedding table,
        of which a step reads one row per sequence (unless it doubles as the LM head)."""
        head = set(self.model.lm_head.parameters())
        table = [p for p in self.model.get_input_embeddings().parameters() if p not in head]
        return self.weight_bytes() - sum(p.numel() * p.element_size() for p in table)

    def allocate_kv_cache(self, spec: KVCacheSpec) -> None:
        """The rank's KV pool; with bucketed shapes it has one block more than
        ``spec.num_blocks``: the pad block."""
        self.block_size = spec.block_size
        self.pad_block = spec.num_blocks
        self.kv_cache = KVCache(self.platform, self.arch, self.num_kv_heads, KVCacheSpec(
            spec.num_blocks + (self.buckets is not None), spec.block_size, spec.dtype))

    def plan(self, out: SchedulerOutput,
             in_flight: InFlightTokens | None = None) -> tuple[StepInput, list[PromptSpan]]:
        """The step every rank runs, and (for rank 0 alone) which rows score prompts."""
        if out.is_empty:
            return StepInput(out.block_ops, None, []), []
        inputs = pack_inputs(out, self.block_size, in_flight and in_flight.rows, self.buckets,
                             self.pad_block)
        spans = _prompt_spans(out)
        return StepInput(out.block_ops, inputs, [(s.row, s.count) for s in spans]), spans

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, step: StepInput, spans: list[PromptSpan],
                in_flight: InFlightTokens | None) -> Forward:
        """Rank 0's part of a planned step, up to its sampling: block moves, the forward pass,
        the logits. The sampling metadata can be built while the device computes."""
        sample_logits, prompt = self._run(step, in_flight and in_flight.token_ids, spans)
        return Forward(out, sample_logits, prompt)

    @torch.inference_mode()
    def sample(self, forward: Forward, sampling: SamplingInputs | None) -> StepResult:
        """The second half: sample (and hand the tokens to the other ranks). The sampled
        tokens are copied to the host in the background (``Executor.fetch_samples`` waits for
        them)."""
        sampled = [s for s in forward.out.scheduled if s.num_sample_positions]
        sampler_output = host_output = ready = None
        if sampled:
            sampler_output = self.sampler(forward.sample_logits,
                                          self._sampling_metadata(sampled, sampling))
            if self.tp.size > 1:
                self.tp.broadcast_from_first(sampler_output.token_ids)
            # Where the host runs ahead, the copy lands later: ``ready`` marks when.
            host_output = SamplerOutput(*(
                None if t is None else t.to("cpu", non_blocking=self.platform.runs_ahead)
                for t in sampler_output))
            ready = self.platform.record_event()
        return StepResult([s.seq for s in sampled], [s.num_sample_positions for s in sampled],
                          sampler_output, host_output, ready, forward.prompt)

    def _sampling_metadata(self, sampled: list[ScheduledSequence],
                           inputs: SamplingInputs) -> SamplingMetadata:
        meta = self.sampling.metadata([s.seq for s in sampled],
                                      [s.num_sample_positions for s in sampled])
        meta.grammar_mask = inputs.grammar_mask
        meta.max_num_logprobs = max(meta.max_num_logprobs, inputs.min_num_logprobs)
        return meta

    @torch.inference_mode()
    def follow(self, step: StepInput) -> None:
        """A rank other than 0 runs the step rank 0 planned, and keeps its sampled tokens."""
        self._run(step, self._last_tokens, [])
        if step.inputs is not None and len(step.inputs.sample_rows):
            counts = step.inputs.sample_counts  # rank 0 sends [num_sampling, max_positions]
            tokens = torch.empty((len(counts), int(counts.max())), dtype=torch.int64,
                                 device=self.device)
            self._last_tokens = self.tp.broadcast_from_first(tokens).view(-1)
        elif step.inputs is not None:
            self._last_tokens = None

    def _run(self, step: StepInput, in_flight_tokens: torch.Tensor | None,
             spans: list[PromptSpan]
             ) -> tuple[torch.Tensor | None, dict[Sequence, PromptLogprobsChunk]]:
        """Block moves, the forward pass, the logits of the sampling rows, and each prompt
        span's logprobs, one span's logits at a time (on ranks other than 0, which get no
        logits, ``spans`` is empty)."""
        self.kv_cache.apply_block_ops(step.block_ops)
        if step.inputs is None:
            return None, {}
        inputs = step.inputs.to_device(self.device, in_flight_tokens)
        if self.lora is not None and step.inputs.lora_requests is not None:
            inputs.ctx.lora_slots = self.lora.row_slots(step.inputs.lora_requests,
                                                        step.inputs.query_lens, self.device)
        hidden = self.run_model(inputs)
        sample_logits = None
        if len(step.inputs.sample_rows):
            sample_logits = self.model.compute_logits(hidden[inputs.logits_indices])
        prompt = {}
        for i, (row, count) in enumerate(step.prompt_rows):
            logits = self.model.compute_logits(hidden[row:row + count])
            if logits is not None:
                prompt[spans[i].seq] = _prompt_logprobs(spans[i], logits)
        return sample_logits, prompt

    def run_model(self, inputs: ModelInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs.ctx):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.ctx)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers,
                                inputs.ctx)
        self.platform.end_forward()
        return hidden

    def capture_graphs(self, max_num_seqs: int) -> None:
        """Capture decode steps where the platform supports graphs (after the KV pool)."""
        runner_cls = self.platform.graph_runner()
        if runner_cls is None:
            return
        self.graphs = runner_cls(self.model, self.kv_cache.layers, max_num_seqs,
                                 self.max_model_len, self.block_size)
        self.graphs.capture()

    def release_graphs(self) -> None:
        """Destroy the captured graphs now rather than at garbage collection: a graph that
        holds a collective keeps a reference on its NCCL communicator, and tearing the
        communicator down (even aborting it) waits until every such graph is gone."""
        if self.graphs is not None:
            self.platform.synchronize()
            self.graphs = None



def _prompt_spans(out: SchedulerOutput) -> list[PromptSpan]:
    spans = []
    row = 0
    for item in out.scheduled:
        seq, start, n = item.seq, item.num_computed_tokens, item.num_new_tokens
        # Rows whose next token is still a prompt token (not after a preemption restart).
        last = min(start + n, seq.num_prompt_tokens - 1)
        if seq.params.prompt_logprobs is not None and seq.num_preemptions == 0 and last > start:
            spans.append(PromptSpan(seq, start, row, last - start))
        row += n
    return spans


def _prompt_logprobs(span: PromptSpan, logits: torch.Tensor) -> PromptLogprobsChunk:
    seq, start = span.seq, span.first_position
    targets = torch.tensor(seq.prompt_token_ids[start + 1:start + 1 + span.count],
                           device=logits.device)
    return PromptLogprobsChunk(
        start, prompt_logprobs(logits.float(), targets, seq.params.prompt_logprobs))
