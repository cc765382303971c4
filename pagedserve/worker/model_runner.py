"""Owns the model weights and the KV pool (``kv_cache.KVCache``) on one device, and runs one
step of the model.

Under tensor parallelism there is one runner per rank, each holding its slice of the weights
and of the KV heads; under pipeline parallelism each holds its stage's layers alone, and the
KV pool of those layers. The driver's runner plans a step (``plan``: the packed inputs, as
plain data every rank can read) and runs it (``forward``, then ``sample``; driven through
``step_api.StepAPI``); the other ranks run the same step (``follow``) so that every collective
inside the forward pass has all its ranks, and every stage receives the hidden states of the
one before it. Only the driver (the last stage's first rank, where the logits are) samples:
the sampler's state (``sampling_batch``: each row's settings and generator, kept across
steps) lives there, so gathering the logits to it moves less than keeping that state
identical on every rank; it then broadcasts the sampled tokens, which the first stage needs
as inputs under async scheduling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedserve.core.sequence import Sequence
from pagedserve.distributed import PipelineStage, TensorParallel, split_heads
from pagedserve.logger import get_logger
from pagedserve.lora.adapter import LoRAAdapter
from pagedserve.lora.slots import LoRASlots, add_lora_layers
from pagedserve.models import moe
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.linear import LinearFactory
from pagedserve.models.offload import LayerOffload
from pagedserve.models.registry import model_class
from pagedserve.platforms.interface import DeviceEvent, GraphRunner, Platform
from pagedserve.quant.formats.base import CheckpointFormat
from pagedserve.quant.linear_method import MatmulNumerics
from pagedserve.quant.weights import LoadedWeight
from pagedserve.sample.logits_processor import LogitsProcessor
from pagedserve.sample.logprobs import LogprobsTensors
from pagedserve.sample.metadata import SamplingMetadata, to_device
from pagedserve.sample.rejection import rejection_sample
from pagedserve.sample.sampler import Sampler, SamplerOutput, prompt_logprobs
from pagedserve.spec_decode.proposer import DRAFTED_ON_DEVICE
from pagedserve.worker.drafter import DeviceDrafts, Drafter
from pagedserve.worker.eagle_drafter import EagleDrafter
from pagedserve.worker.input_batch import (
    HostInputs,
    InFlightTokens,
    ModelInputs,
    pack_inputs,
)
from pagedserve.worker.kv_cache import KVCache, KVCacheSpec
from pagedserve.worker.pooler import Pooled, Pooler, pooling_chunks
from pagedserve.worker.sampling_batch import SamplingBatch
from pagedserve.worker.shape_buckets import ShapeBuckets
from pagedserve.worker.sleep import SleepingWeights
from pagedserve.worker.step import (
    Forward,
    HostSamples,
    PromptLogprobsChunk,
    SamplingInputs,
    StepOutput,
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


class _QueuedStep(NamedTuple):
    """What a step left on the device for the host: its samples, being copied to the host in
    the background until ``ready``, and its prompt logprobs."""

    samples: SamplerOutput | None  # host tensors
    num_emitted: torch.Tensor | None  # host, int64 [N]: a verify step's tokens per row
    ready: DeviceEvent | None
    prompt: dict[Sequence, tuple[int, LogprobsTensors]]  # seq -> (first position, logprobs)
    pooled: Pooled | None  # host tensors


class _Ran(NamedTuple):
    """What a step's forward pass leaves on the driver."""

    logits: torch.Tensor | None  # the sampling rows'
    prompt: dict[Sequence, tuple[int, LogprobsTensors]]
    drafts: DeviceDrafts | None  # the draft model's or the head's, drawn in this step
    # With an EAGLE-3 head: the step's inputs and the target's auxiliary hidden states, which
    # its extend pass reads once the step has sampled.
    head_inputs: tuple[ModelInputs, HostInputs, torch.Tensor] | None
    pooled: Pooled | None = None  # pooling streams whose prompt the step finished


class _Forwarded(NamedTuple):
    """What a step's first half leaves for its second, on the driver."""

    step_id: int
    ran: _Ran


@dataclass(frozen=True)
class RankControl:
    """Sleep mode and weight updates, run by every rank between steps (``ModelRunner.control``):
    sleep at ``sleep_level`` (1 or 2), wake up what ``wake_tags`` name, or load ``weights``
    (checkpoint names and host tensors; each rank keeps its slice)."""

    sleep_level: int = 0
    wake_tags: tuple[str, ...] = ()
    weights: list[tuple[str, torch.Tensor]] | None = None


@dataclass
class StepInput:
    """What every rank runs for one step: plain data, the same on all ranks."""

    block_ops: BlockOps
    inputs: HostInputs | None  # None: only block moves (nothing scheduled)
    prompt_rows: list[tuple[int, int]]  # (row, count) of each PromptSpan, in order
    # Adapters (lora_int_id) to forget before the step: no request runs with them any more.
    removed_loras: list[int] = field(default_factory=list)
    # Adapters to hold in host memory from now on, read and checked by the engine.
    added_loras: dict[int, LoRAAdapter] = field(default_factory=dict)
    control: RankControl | None = None  # instead of a step: sleep, wake up, load weights


class ModelRunner:
    def __init__(self, platform: type[Platform], arch: ModelArchConfig, dtype: torch.dtype,
                 max_model_len: int, kv_cache_dtype: str = "auto",
                 quantizer: Callable[[torch.Tensor], LoadedWeight] | None = None,
                 buckets: ShapeBuckets | None = None,
                 tp: TensorParallel = TensorParallel(), cpu_offload_bytes: int = 0,
                 numerics: MatmulNumerics = MatmulNumerics(),
                 logits_processors: Iterable[LogitsProcessor] = (),
                 lm_head: bool = True, stage: PipelineStage = PipelineStage()) -> None:
        """``lm_head=False``: the model is built without its LM head (``--runner pooling``,
        which never computes logits), so a checkpoint's head is never held. ``stage``: the
        decoder layers this rank runs, and its neighbours (the whole model by default)."""
        self.platform = platform
        self.arch = arch
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.tp = tp
        self.stage = stage
        self.num_layers = len(stage.layer_range(arch.num_layers))  # this stage's
        self.device = platform.device()
        self.kv_dtype = platform.kv_cache_torch_dtype(kv_cache_dtype, dtype)
        heads = split_heads(arch.num_heads, arch.num_kv_heads, tp)
        self.num_kv_heads = heads.num_kv_heads
        backend_cls = platform.attention_backend()
        backend = backend_cls(heads.num_heads, arch.head_dim, heads.num_kv_heads,
                              arch.attention_scale, kv_cache_dtype=kv_cache_dtype)
        linears = LinearFactory(platform, dtype, self.device, quantizer, tp, numerics)
        with torch.device(self.device):
            model = model_class(arch.architecture)(arch, backend, max_model_len,
                                                    platform.layer_ops(), linears,
                                                    lm_head=lm_head, stage=stage)
        self.model = model.to(dtype=dtype).eval()
        # --cpu-offload-gb: decoder layers in host memory, streamed in per forward pass.
        self.offload = (LayerOffload(self.model, self.model.layers_prefix,
                                     stage.layer_range(arch.num_layers), cpu_offload_bytes,
                                     platform) if cpu_offload_bytes else None)
        self.sampler = Sampler()
        # Used by the driver alone, but every rank makes its own processors
        # (--logits-processors).
        self.sampling = SamplingBatch(arch.vocab_size, self.device,
                                      processors=logits_processors)
        self.kv_cache: KVCache | None = None
        self.block_size = 16
        self.graphs: GraphRunner | None = None
        # The last step's sampled tokens, on the device: the inputs of a step scheduled
        # before the host has seen them. The driver knows whose they are; the other ranks
        # are told which to read (``HostInputs.fill_sources``).
        self._in_flight: InFlightTokens | None = None  # the driver
        self._last_tokens: torch.Tensor | None = None  # the other ranks
        # The driver, between a step's halves: its logits and prompt logprobs, by step id.
        self._step_id = 0
        self._forwarded: _Forwarded | None = None
        self._queued: dict[int, _QueuedStep] = {}  # steps sampled, not yet fetched
        self.buckets = buckets  # pad every step to these shapes (shape_buckets.py)
        self.pad_block = 0  # with buckets: the pool's last block, written by padded rows only
        self.lora: LoRASlots | None = None  # with --enable-lora: the adapters' device slots
        # The driver, with a draft model or an EAGLE-3 head (speculative decoding).
        self.drafter: Drafter | EagleDrafter | None = None
        self.pooler: Pooler | None = None  # the driver, with --runner pooling
        # Sleep mode: the pool's spec and the graphs' sizes, to make them again on wake-up;
        # the weights while they are asleep.
        self._kv_spec: KVCacheSpec | None = None
        self._graph_sizes: tuple[int, int] | None = None
        self.sleeping_weights: SleepingWeights | None = None
        # How the checkpoint's tensors are read (quantized formats); None: as they come.
        self.checkpoint_format: CheckpointFormat | None = None

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        """Load the checkpoint; with CPU offload, each offloaded layer leaves the device as
        soon as it is complete, so the whole model is never on the device at once."""
        if self.offload is None:
            self.model.load_weights(weights)
            return
        # Under the model's names, which the offload reads to know when a layer is complete.
        canonical = self.model.canonical_weights(weights)
        self.model.load_weights(self.offload.while_loading(canonical))
        self.offload.finish()

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights of the checkpoint's shapes, generated on the device and loaded like
        a checkpoint's: norms at 1, the rest small normal values so activations stay in range
        at any depth.

        Each tensor is made only when the model asks for the next one (a generator, never a
        list), so with CPU offload an offloaded layer has left the device before the next is
        made: the device holds the resident layers and one more, host memory the offloaded
        layers alone. That is how a model larger than both runs: Llama-3-70B's 131 GiB on one
        H200 (139 GiB) with 128 GiB of host memory, of which the offloaded part is pinned."""
        generator = torch.Generator(device=self.device).manual_seed(seed)

        def tensors():
            for name, shape in self.model.checkpoint_shapes().items():
                if "norm" in name:
                    yield name, torch.ones(shape, dtype=self.dtype, device=self.device)
                else:
                    yield name, torch.empty(shape, dtype=self.dtype, device=self.device).normal_(
                        0.0, 0.02, generator=generator)

        self.load_weights(tensors())

    def add_lora(self, max_loras: int, max_rank: int) -> None:
        """Wrap the loaded model's projections in LoRA layers of ``max_loras`` slots."""
        self.lora = add_lora_layers(self.model, self.platform.lora_ops(), max_loras, max_rank,
                                    self.platform.memory_info().free_bytes,
                                    pin=self.platform.pin_swap_memory)

    def add_drafter(self, drafter: Drafter | EagleDrafter) -> None:
        """Verify drafts of a draft model (``worker/drafter.py``) or an EAGLE-3 head
        (``worker/eagle_drafter.py``), drawn inside each verify step; its KV pool is
        allocated with this one's. An EAGLE-3 head reads this model's auxiliary hidden
        states."""
        self.drafter = drafter
        if isinstance(drafter, EagleDrafter):
            self.model.model.aux_layers = drafter.head.config.aux_layer_ids
            drafter.head.share_embedding(self.model.get_input_embeddings())

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Device bytes of one KV block of this rank (its stage's layers): the model's and its
        draft model's."""
        spec = KVCacheSpec(1, block_size, self.kv_dtype)
        own = spec.bytes_per_block(self.arch, self.num_kv_heads, self.num_layers)
        return own if self.drafter is None else own + self.drafter.kv_bytes_per_block(spec)

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters, wherever they are held."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def resident_weight_bytes(self) -> int:
        """Device bytes the weights take: with CPU offload, the resident parameters and the
        staging slots (the offloaded layers' own bytes are in host memory)."""
        if self.offload is None:
            return self.weight_bytes()
        return self.offload.staging_bytes + sum(
            p.numel() * p.element_size() for p in self.model.parameters()
            if not self.offload.holds(p))

    def weight_bytes_read_per_token_step(self, batch: int = 1) -> int:
        """Weight bytes a decode step of ``batch`` sequences reads: every parameter except the
        input embedding table, of which a step reads one row per sequence (unless it doubles
        as the LM head), and of a mixture-of-experts layer's experts only those the batch is
        routed to, as many as uniform routing touches on average (``moe.expected_experts``):
        8 of Qwen3-30B-A3B's 128 at batch 1."""
        head = set() if self.model.lm_head is None else set(self.model.lm_head.parameters())
        embedding = self.model.get_input_embeddings()  # None past the first stage
        table = [] if embedding is None else [p for p in embedding.parameters() if p not in head]
        untouched = sum(block.expert_bytes() * (1 - block.expected_experts(batch)
                                                / block.experts.num_experts)
                        for block in self.model.modules() if isinstance(block, moe.SparseMoeBlock))
        return round(self.weight_bytes() - sum(p.numel() * p.element_size() for p in table)
                     - untouched)

    def allocate_kv_cache(self, spec: KVCacheSpec) -> None:
        """The rank's KV pool; with bucketed shapes it has one block more than
        ``spec.num_blocks``: the pad block."""
        self._kv_spec = spec
        self.block_size = spec.block_size
        self.pad_block = spec.num_blocks
        padded = KVCacheSpec(spec.num_blocks + (self.buckets is not None), spec.block_size,
                             spec.dtype)
        self.kv_cache = KVCache(self.platform, self.arch, self.num_kv_heads, padded,
                                self.num_layers)
        if self.drafter is not None:  # the same block ids address both pools
            self.drafter.allocate_kv_cache(padded)

    def plan(self, out: SchedulerOutput) -> tuple[StepInput, list[PromptSpan]]:
        """The step every rank runs, and (for the driver alone) which rows score prompts."""
        if out.is_empty:
            return StepInput(out.block_ops, None, []), []
        inputs = pack_inputs(out, self.block_size, self._in_flight and self._in_flight.rows,
                             self.buckets, self.pad_block)
        spans = _prompt_spans(out)
        return StepInput(out.block_ops, inputs, [(s.row, s.count) for s in spans]), spans

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, step: StepInput, spans: list[PromptSpan]
                ) -> Forward:
        """The driver's part of a planned step, up to its sampling: block moves, the forward pass,
        the logits, kept here until ``sample``. The sampling metadata can be built while the
        device computes."""
        ran = self._run(step, self._in_flight and self._in_flight.token_ids, spans,
                        out.scheduled)
        self._step_id += 1
        self._forwarded = _Forwarded(self._step_id, ran)
        return Forward(out, self._step_id)

    @torch.inference_mode()
    def sample(self, forward: Forward, sampling: SamplingInputs | None) -> StepResult:
        """The second half: sample (and hand the tokens to the other ranks). The sampled
        tokens are copied to the host in the background (``fetch`` waits for them)."""
        step_id, (logits, prompt, drafts, head_inputs, pooled) = self._forwarded
        if step_id != forward.step_id:
            raise RuntimeError(f"step {forward.step_id} was not the last one forwarded")
        self._forwarded = None
        sampled = [s for s in forward.out.scheduled if s.num_sample_positions]
        seqs = [s.seq for s in sampled]
        counts = [s.num_sample_positions for s in sampled]
        host_output = host_emitted = num_emitted = ready = sampler_output = None
        if sampled:
            meta = self._sampling_metadata(seqs, counts, sampling)
            if any(s.draft_token_ids for s in sampled):
                sampler_output, num_emitted = self._verify(logits, meta, sampled, drafts)
            else:
                sampler_output = self.sampler(logits, meta)
            if self.stage.layout.size > 1:
                self.stage.layout.broadcast_from_driver(sampler_output.token_ids)
            self._keep_in_flight(seqs, counts, sampler_output.token_ids)
            # Where the host runs ahead, the copy lands later: ``ready`` marks when.
            host_output, host_emitted = _to_host(self.platform, sampler_output, num_emitted)
            ready = self.platform.record_event()
        if head_inputs is not None:  # the EAGLE-3 head's pass over the step, now it sampled
            self.drafter.extend(*head_inputs, forward.out.scheduled, sampled,
                                sampler_output and sampler_output.token_ids, num_emitted)
        if pooled is not None:
            pooled = Pooled(pooled.seqs, pooled.vectors.to(
                "cpu", non_blocking=self.platform.runs_ahead))
            ready = self.platform.record_event()
        self._queued[step_id] = _QueuedStep(host_output, host_emitted, ready, prompt, pooled)
        return StepResult(step_id, seqs, counts)

    def _verify(self, logits: torch.Tensor, meta: SamplingMetadata,
                sampled: list[ScheduledSequence], drafted: DeviceDrafts | None
                ) -> tuple[SamplerOutput, torch.Tensor]:
        """A verify step's tokens: each row's accepted drafts and one token of the target's
        (``sample/rejection.py``), and how many that makes per row. The drafts are the
        scheduler's (n-gram), or the draft model's drawn in this step (``drafted``)."""
        width = max(len(s.draft_token_ids) for s in sampled)
        if drafted is None:
            drafts = np.full((len(sampled), width), -1, dtype=np.int64)
            for i, s in enumerate(sampled):
                drafts[i, :len(s.draft_token_ids)] = s.draft_token_ids
            out = rejection_sample(logits, meta, torch.from_numpy(drafts).to(
                self.device, non_blocking=True))
            return out.sampled, out.num_emitted
        rows = to_device([i for i, s in enumerate(sampled) if s.draft_token_ids], torch.int64,
                         self.device)
        drafts = torch.full((len(sampled), width), -1, dtype=torch.int64, device=self.device)
        drafts[rows] = drafted.token_ids
        out = rejection_sample(logits, meta, drafts, drafted.probs)
        return out.sampled, out.num_emitted

    def fetch(self, result: StepResult) -> StepOutput:
        """A sampled step's tokens and logprobs on the host, waiting for the device if need
        be. Steps queued before it and never fetched (the engine dropped them: their requests
        finished) are forgotten."""
        queued = self._queued.pop(result.step_id)
        for stale in [i for i in self._queued if i < result.step_id]:
            del self._queued[stale]
        if queued.ready is not None:
            queued.ready.synchronize()
        samples = None
        if queued.samples is not None:
            samples = HostSamples(queued.samples.token_ids.tolist(), *(
                None if t is None else t.tolist() for t in queued.samples[1:]),
                counts=None if queued.num_emitted is None else queued.num_emitted.tolist())
        pooled = {} if queued.pooled is None else queued.pooled.embeddings()
        return StepOutput(samples, {seq: _host_chunk(first, r)
                                    for seq, (first, r) in queued.prompt.items()}, pooled)

    def _keep_in_flight(self, seqs: list[Sequence], counts: list[int],
                        token_ids: torch.Tensor) -> None:
        """Remember the step's tokens ([num_sampled, max_positions]) for the next step's
        inputs: a stream's next input is its last sampled token, at ``row * width + count -
        1`` of the flat view."""
        last = np.arange(len(counts)) * token_ids.shape[1] + np.asarray(counts) - 1
        self._in_flight = InFlightTokens(token_ids.view(-1), dict(zip(seqs, last.tolist())))

    def _sampling_metadata(self, seqs: list[Sequence], counts: list[int],
                           inputs: SamplingInputs) -> SamplingMetadata:
        meta = self.sampling.metadata(seqs, counts)
        if inputs.grammar_mask is not None:
            meta.grammar_mask = inputs.grammar_mask.to(self.device)
        meta.max_num_logprobs = max(meta.max_num_logprobs, inputs.min_num_logprobs)
        return meta

    @torch.inference_mode()
    def follow(self, step: StepInput) -> None:
        """A rank other than the driver runs the step the driver planned, and keeps its
        sampled tokens."""
        if step.control is not None:
            self.control(step.control)
            return
        self._run(step, self._last_tokens, [])
        if step.inputs is not None and len(step.inputs.sample_rows):
            counts = step.inputs.sample_counts  # the driver sends [num_sampling, max_positions]
            tokens = torch.empty((len(counts), int(counts.max())), dtype=torch.int64,
                                 device=self.device)
            self._last_tokens = self.stage.layout.broadcast_from_driver(tokens).view(-1)
        elif step.inputs is not None:
            self._last_tokens = None

    def _run(self, step: StepInput, in_flight_tokens: torch.Tensor | None,
             spans: list[PromptSpan], scheduled: list[ScheduledSequence] | None = None
             ) -> _Ran:
        """Block moves, the draft model's drafts, the forward pass, the logits of the sampling
        rows, and each prompt span's logprobs, one span's logits at a time (on ranks other
        than the driver, which get no logits and no ``scheduled``, ``spans`` is empty; a stage
        before the last computes no logits at all); with an EAGLE-3 head, what its pass after
        the sampling reads: the step's inputs and the auxiliary hidden states; with a pooler,
        the pooled vectors of the streams whose prompt the step finished (the driver)."""
        self.kv_cache.apply_block_ops(step.block_ops)
        if self.drafter is not None and step.block_ops.copies:
            self.drafter.copy_blocks(step.block_ops.copies)
        if step.removed_loras:
            self.lora.remove(step.removed_loras)
        for lora_int_id, adapter in step.added_loras.items():
            self.lora.add(lora_int_id, adapter)
        if step.inputs is None:
            return _Ran(None, {}, None, None)
        inputs = step.inputs.to_device(self.device, in_flight_tokens)
        drafts = self._fill_drafts(step.inputs, inputs.input_ids, scheduled)
        if self.lora is not None and step.inputs.lora_requests is not None:
            inputs.ctx.lora_slots = self.lora.row_slots(step.inputs.lora_requests,
                                                        step.inputs.query_lens, self.device)
        hidden, aux = self._forward_pass(inputs)
        if hidden is None:  # a stage before the last: its share went to the next stage
            return _Ran(None, {}, drafts, None)
        sample_logits = None
        if len(step.inputs.sample_rows):
            sample_logits = self.model.compute_logits(hidden[inputs.logits_indices])
        prompt = {}
        for i, (row, count) in enumerate(step.prompt_rows):
            logits = self.model.compute_logits(hidden[row:row + count])
            if logits is not None:
                prompt[spans[i].seq] = _prompt_logprobs(spans[i], logits)
        return _Ran(sample_logits, prompt, drafts,
                    None if aux is None else (inputs, step.inputs, aux),
                    self._pool(hidden, scheduled))

    def _pool(self, hidden: torch.Tensor, scheduled: list[ScheduledSequence] | None
              ) -> Pooled | None:
        if self.pooler is None or scheduled is None:
            return None
        chunks = pooling_chunks(scheduled)
        return None if chunks is None else self.pooler(hidden, chunks)

    def _fill_drafts(self, host: HostInputs, input_ids: torch.Tensor,
                     scheduled: list[ScheduledSequence] | None) -> DeviceDrafts | None:
        """Draw the draft model's drafts (the driver) into the step's draft slots, and hand
        them to the other ranks, which read the same slots from the same inputs."""
        rows = np.flatnonzero(host.input_ids == DRAFTED_ON_DEVICE)
        if not len(rows):
            return None
        drafts = None
        if scheduled is not None:
            drafts = self.drafter.propose(scheduled, self.sampling)
            tokens = drafts.flat
        else:
            tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        if self.stage.layout.size > 1:
            self.stage.layout.broadcast_from_driver(tokens)
        input_ids[torch.from_numpy(rows).to(self.device, non_blocking=True)] = tokens
        return drafts

    def run_model(self, inputs: ModelInputs) -> torch.Tensor | None:
        """The final hidden states; None on a stage before the last."""
        return self._forward_pass(inputs)[0]

    def _forward_pass(self, inputs: ModelInputs
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The hidden states, and the auxiliary ones an EAGLE-3 head reads (None: none). A
        stage after the first starts from the previous stage's hidden states; one before the
        last sends its own to the next and returns None."""
        if self.graphs is not None and self.graphs.can_run(inputs.ctx):
            out = self.graphs.run(inputs.input_ids, inputs.positions, inputs.ctx)
        else:
            incoming = None if self.stage.is_first else self.stage.recv(
                len(inputs.input_ids), self.arch.hidden_size, self.dtype, self.device)
            out = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers,
                             inputs.ctx, incoming)
            if not self.stage.is_last:
                self.stage.send(out)
                out = None
        self.platform.end_forward()
        return out if isinstance(out, tuple) else (out, None)

    def capture_graphs(self, max_num_seqs: int, verify_len: int = 1) -> None:
        """Capture decode steps where the platform supports graphs (after the KV pool), and
        verify steps of up to ``verify_len`` tokens per sequence (speculative decoding)."""
        self._graph_sizes = (max_num_seqs, verify_len)
        runner_cls = self.platform.graph_runner()
        if runner_cls is None:
            return
        if self.offload is not None:
            # The offload's copies are issued per pass by hooks, on the host: a replayed graph
            # would keep whatever its slots held at capture. Eager it is.
            logger.info("cpu offload: decode steps run eagerly (no graphs are captured)")
            return
        if self.stage.layout.pp_size > 1:
            # Each stage's pass waits on the stage before it, outside any graph; the graph
            # runners replay a whole model's pass from its input tokens.
            logger.info("pipeline parallelism: steps run eagerly (no graphs are captured)")
            return
        if moe.syncs_with_host(self.model):
            # The portable experts op reads its per-expert counts on the host, and quantized
            # experts which experts to dequantize.
            logger.info("mixture of experts: decode steps run eagerly (this platform's "
                        "fused_moe, or the per-step dequantization of quantized experts, "
                        "syncs with the host; no graphs are captured)")
            return
        self.graphs = runner_cls(self.model, self.kv_cache.layers, max_num_seqs,
                                 self.max_model_len, self.block_size, verify_len)
        self.graphs.capture()

    def release_graphs(self) -> None:
        """Destroy the captured graphs now rather than at garbage collection: a graph that
        holds a collective keeps a reference on its NCCL communicator, and tearing the
        communicator down (even aborting it) waits until every such graph is gone."""
        if self.graphs is not None:
            self.platform.synchronize()
            self.graphs = None

    # ---- sleep mode (worker/sleep.py) ---------------------------------------------------
    @torch.no_grad()
    def control(self, c: RankControl) -> None:
        """Sleep, wake up or load weights, as the driver told every rank (``RankControl``)."""
        if c.sleep_level:
            self.sleep(c.sleep_level)
        if c.wake_tags:
            self.wake_up(c.wake_tags)
        if c.weights is not None:
            # Loading builds each layer's weight anew (packed, transposed for its method) and
            # frees the old: graphs captured before would replay the freed addresses.
            recapture = self.graphs is not None
            self.release_graphs()
            fmt = self.checkpoint_format
            self.load_weights(c.weights if fmt is None else fmt.read(iter(c.weights)))
            if recapture:
                self.capture_graphs(*self._graph_sizes)

    def sleep(self, level: int) -> None:
        """Free the device: graphs, the KV pool (its contents are lost), and the weights
        (level 1: to host memory; level 2: discarded). No step may be in flight."""
        self.release_graphs()
        self.kv_cache = None
        self._in_flight = self._last_tokens = self._forwarded = None
        self._queued.clear()
        if self.sleeping_weights is None:
            self.sleeping_weights = SleepingWeights(self.model, self.platform,
                                                    discard=level == 2)
        self.platform.release_cached_memory()

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Bring back what ``tags`` name ("weights", "kv_cache": an empty pool of the same
        size); once both are back, capture the graphs again (the tensors' addresses are new)."""
        if "weights" in tags and self.sleeping_weights is not None:
            self.sleeping_weights.restore()
            self.sleeping_weights = None
        if "kv_cache" in tags and self.kv_cache is None:
            self.allocate_kv_cache(self._kv_spec)
        if self.is_awake and self.graphs is None and self._graph_sizes is not None:
            self.capture_graphs(*self._graph_sizes)

    @property
    def is_awake(self) -> bool:
        return self.sleeping_weights is None and self.kv_cache is not None



def _to_host(platform: type[Platform], out: SamplerOutput, num_emitted: torch.Tensor | None
             ) -> tuple[SamplerOutput, torch.Tensor | None]:
    """Start copying a step's samples to the host, without waiting where the host runs
    ahead of the device."""
    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to("cpu", non_blocking=platform.runs_ahead)

    return SamplerOutput(*(copy(t) for t in out)), copy(num_emitted)


def _prompt_spans(out: SchedulerOutput) -> list[PromptSpan]:
    spans = []
    row = 0
    for item in out.scheduled:
        seq = item.seq
        if seq.params.prompt_logprobs is not None and seq.num_preemptions == 0:
            # Rows whose next token is still a prompt token (not after a preemption restart).
            start = item.num_computed_tokens
            last = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if last > start:
                spans.append(PromptSpan(seq, start, row, last - start))
        row += item.num_new_tokens
    return spans


def _prompt_logprobs(span: PromptSpan, logits: torch.Tensor) -> tuple[int, LogprobsTensors]:
    seq, start = span.seq, span.first_position
    targets = torch.tensor(seq.prompt_token_ids[start + 1:start + 1 + span.count],
                           device=logits.device)
    return start, prompt_logprobs(logits.float(), targets, seq.params.prompt_logprobs)


def _host_chunk(first_position: int, r: LogprobsTensors) -> PromptLogprobsChunk:
    n = len(r.logprobs)
    return PromptLogprobsChunk(
        first_position, r.logprobs.tolist(), r.ranks.tolist(),
        r.top_ids.tolist() if r.top_ids is not None else [[]] * n,
        r.top_logprobs.tolist() if r.top_logprobs is not None else [[]] * n)
