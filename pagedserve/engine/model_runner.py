"""Owns the model weights and the KV cache on one device, and runs one step of the model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.core.sequence import Sequence
from pagedserve.engine.input_batch import InFlightTokens, build_inputs
from pagedserve.logger import get_logger
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.linear import LinearFactory
from pagedserve.models.registry import model_class
from pagedserve.platforms.interface import DeviceEvent, GraphRunner, Platform
from pagedserve.quant.weights import LoadedWeight
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


class Forward(NamedTuple):
    """A step whose forward pass is queued and whose sampling is not."""

    out: SchedulerOutput
    hidden: torch.Tensor  # [tokens, hidden] on the device
    logits_indices: torch.Tensor  # the rows of ``hidden`` that sample


class StepResult(NamedTuple):
    sampled: list[Sequence]  # the streams that sampled, in sampler row order
    sampler_output: SamplerOutput | None  # on the device
    # The same, copied to the host without blocking; readable once ``ready`` has passed.
    host_output: SamplerOutput | None
    ready: DeviceEvent | None
    prompt_logprobs: dict[Sequence, PromptLogprobsChunk]

    def in_flight_tokens(self) -> InFlightTokens | None:
        if self.sampler_output is None:
            return None
        return InFlightTokens(self.sampler_output.token_ids,
                              {seq: row for row, seq in enumerate(self.sampled)})


class ModelRunner:
    def __init__(self, platform: type[Platform], arch: ModelArchConfig, dtype: torch.dtype,
                 max_model_len: int, kv_cache_dtype: str = "auto",
                 quantizer: Callable[[torch.Tensor], LoadedWeight] | None = None) -> None:
        self.platform = platform
        self.arch = arch
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.device = platform.device()
        self.kv_dtype = platform.kv_cache_torch_dtype(kv_cache_dtype, dtype)
        backend_cls = platform.attention_backend()
        backend = backend_cls(arch.num_heads, arch.head_dim, arch.num_kv_heads,
                              arch.head_dim ** -0.5, kv_cache_dtype=kv_cache_dtype)
        linears = LinearFactory(platform, dtype, self.device, quantizer)
        with torch.device(self.device):
            model = model_class(arch.architecture)(arch, backend, max_model_len,
                                                    platform.layer_ops(), linears)
        self.model = model.to(dtype=dtype).eval()
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.swap_cache: torch.Tensor | None = None  # host pool, allocated at the first swap
        self.block_size = 16
        self.graphs: GraphRunner | None = None

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

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def weight_bytes_read_per_token_step(self) -> int:
        """Weight bytes a decode step reads: every parameter except the input embedding table,
        of which a step reads one row per sequence (unless it doubles as the LM head)."""
        head = set(self.model.lm_head.parameters())
        table = [p for p in self.model.get_input_embeddings().parameters() if p not in head]
        return self.weight_bytes() - sum(p.numel() * p.element_size() for p in table)

    def allocate_kv_cache(self, spec: KVCacheSpec) -> None:
        """One tensor ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` so block copies and
        swaps move every layer at once; each layer attends over its own view."""
        a = self.arch
        self.block_size = spec.block_size
        self.kv_cache = self.platform.allocate_kv_cache(
            (a.num_layers, 2, spec.num_blocks, spec.block_size, a.num_kv_heads, a.head_dim),
            spec.dtype)
        self.kv_caches = list(self.kv_cache.unbind(0))

    def execute(self, out: SchedulerOutput, sampling: SamplingMetadata | None,
                in_flight: InFlightTokens | None = None) -> StepResult:
        """Queue one step on the device and return without waiting for it: the sampled
        tokens are copied to the host in the background (``fetch_samples`` waits for them).
        ``in_flight``: the previous step's tokens, for chunks whose input is one of them."""
        return self.sample(self.forward(out, in_flight), sampling)

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, in_flight: InFlightTokens | None = None) -> Forward:
        """The first half of ``execute``: queue the block operations and the forward pass.
        The sampling metadata can then be built while the device computes."""
        self.apply_block_ops(out.block_ops)
        inputs = build_inputs(out, self.block_size, self.device, in_flight)
        return Forward(out, self._forward(inputs), inputs.logits_indices)

    @torch.inference_mode()
    def sample(self, forward: Forward, sampling: SamplingMetadata | None) -> StepResult:
        """The second half of ``execute``: queue the sampler on the forward pass's logits."""
        out, hidden = forward.out, forward.hidden
        sampled = [s.seq for s in out.scheduled if s.samples]
        sampler_output = host_output = ready = None
        if sampled:
            logits = self.model.compute_logits(hidden[forward.logits_indices])
            sampler_output = self.sampler(logits.float(), sampling)
            # Where the host runs ahead, the copy lands later: ``ready`` marks when.
            host_output = SamplerOutput(*(
                None if t is None else t.to("cpu", non_blocking=self.platform.runs_ahead)
                for t in sampler_output))
            ready = self.platform.record_event()
        return StepResult(sampled, sampler_output, host_output, ready,
                          self._prompt_logprobs(out, hidden))

    @staticmethod
    def fetch_samples(result: StepResult) -> SamplerOutput:
        """The step's sampled tokens on the host, waiting for the device if need be."""
        if result.ready is not None:
            result.ready.synchronize()
        return result.host_output

    @torch.inference_mode()
    def apply_block_ops(self, ops: BlockOps) -> None:
        """Swap and copy whole blocks (all layers, keys and values) in the order the scheduler
        relies on: swap-outs, swap-ins, then copy-on-write copies. The host swap pool is
        allocated at the first swap, in page-locked memory where the platform wants it."""
        if (ops.swap_out or ops.swap_in) and self.swap_cache is None:
            shape = list(self.kv_cache.shape)
            shape[2] = ops.num_host_blocks
            self.swap_cache = torch.empty(shape, dtype=self.kv_cache.dtype,
                                          pin_memory=self.platform.pin_swap_memory)
        for pairs, src_cache, dst_cache in ((ops.swap_out, self.kv_cache, self.swap_cache),
                                            (ops.swap_in, self.swap_cache, self.kv_cache)):
            if pairs:
                src, dst = torch.tensor(pairs, dtype=torch.int64).unbind(1)
                self.platform.swap_blocks(src_cache, dst_cache, src, dst)
                # The host side of a swap is read or reused as soon as this returns.
                self.platform.synchronize()
        if ops.copies:
            src, dst = torch.tensor(ops.copies, dtype=torch.int64, device=self.device).unbind(1)
            self.platform.copy_blocks(self.kv_cache, src, dst)

    def _forward(self, inputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs.meta):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def capture_graphs(self, max_num_seqs: int) -> None:
        """Capture decode steps where the platform supports graphs (after the KV pool)."""
        runner_cls = self.platform.graph_runner()
        if runner_cls is None:
            return
        self.graphs = runner_cls(self.model, self.kv_caches, max_num_seqs, self.max_model_len,
                                 self.block_size)
        self.graphs.capture()

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, max_num_seqs: int, block_size: int) -> int:
        """Peak device bytes of a forward over ``num_tokens`` prompt tokens plus sampling for
        ``max_num_seqs`` rows, with a throwaway KV pool just large enough. The tokens are split
        into prompts of at most ``max_model_len``, as a real step's would be."""
        from pagedserve.core.scheduler import ScheduledSequence, SchedulerOutput
        from pagedserve.sampling_params import SamplingParams

        lengths = [min(self.max_model_len, num_tokens - start)
                   for start in range(0, num_tokens, self.max_model_len)]
        tables, next_block = [], 0
        for n in lengths:
            blocks = -(-n // block_size)
            tables.append(list(range(next_block, next_block + blocks)))
            next_block += blocks
        self.platform.reset_peak_memory()
        self.allocate_kv_cache(KVCacheSpec(next_block, block_size, self.kv_dtype))
        out = SchedulerOutput([
            ScheduledSequence(Sequence([0] * n, SamplingParams(), max_tokens=1),
                              0, n, table, samples=True)
            for n, table in zip(lengths, tables)])
        hidden = self._forward(build_inputs(out, block_size, self.device))
        rows = hidden[-1:].expand(max_num_seqs, -1)
        self.model.compute_logits(rows).float().softmax(-1)
        self.platform.synchronize()
        peak = self.platform.peak_memory_bytes()
        self.kv_cache, self.kv_caches = None, []
        return peak

    def _prompt_logprobs(self, out: SchedulerOutput,
                         hidden: torch.Tensor) -> dict[Sequence, PromptLogprobsChunk]:
        results = {}
        row = 0
        for item in out.scheduled:
            seq, start, n = item.seq, item.num_computed_tokens, item.num_new_tokens
            k = seq.params.prompt_logprobs
            # Rows whose next token is still a prompt token (not after a preemption restart).
            last = min(start + n, seq.num_prompt_tokens - 1)
            if k is not None and seq.num_preemptions == 0 and last > start:
                rows = hidden[row:row + last - start]
                targets = torch.tensor(seq.prompt_token_ids[start + 1:last + 1],
                                       device=hidden.device)
                logits = self.model.compute_logits(rows).float()
                results[seq] = PromptLogprobsChunk(
                    start, prompt_logprobs(logits, targets, k))
            row += n
        return results
