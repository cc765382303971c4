"""The engine: add requests, call ``step`` until done, read ``RequestOutput``s.

A request passes three stages, each a module of its own:

1. ``input_processor``: validate and tokenize; build the core's ``SequenceGroup`` and the
   engine's ``RequestState``.
2. the core step, here: the scheduler picks the tokens to compute (``core/scheduler``), the
   model runner computes them and samples (``model_runner``), the scheduler marks them done.
3. ``output_processor``: append the sampled tokens, detokenize, check stops, record logprobs,
   let the beam driver pick beams (``beam_driver``), build ``RequestOutput``s.

Async scheduling (default where the platform's host runs ahead of the device): a step queues
its forward pass, then applies the previous step's tokens while the device computes, so the
host's per-step work hides behind the device's. The step after is scheduled before the host
has seen those tokens; a sequence then takes its next input from the previous step's output on
the device, and a sequence that turns out to have stopped wastes one step, whose token is
dropped. Requests whose next logits depend on the host's view of earlier tokens (penalties,
min_tokens, beam search, prompt logprobs) switch the engine back to one step at a time.
"""

from __future__ import annotations

import time

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.core.sequence import SequenceStatus
from pagedserve.engine.beam_driver import BeamDriver
from pagedserve.engine.input_processor import InputLimits, InputProcessor
from pagedserve.engine.model_runner import StepResult
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.stats import EngineStats
from pagedserve.executor.executor import Executor
from pagedserve.logger import get_logger
from pagedserve.models import loader
from pagedserve.outputs import RequestOutput
from pagedserve.platforms import resolve_platform
from pagedserve.sample.metadata import SamplingMetadata
from pagedserve.sampling_params import SamplingParams

logger = get_logger(__name__)

class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        self.platform = resolve_platform(config.device)
        source = loader.resolve_model(config.model, config.load_format != "dummy",
                                      revision=config.revision, gguf_file=config.gguf_file)
        self.model_name = config.served_model_name or source.name
        self.arch = loader.load_arch_config(source)
        self.tokenizer = loader.load_tokenizer(source)
        self.resolved = config.resolve(self.arch, self.platform)
        self.dtype = self.resolved.dtype
        self.max_model_len = self.resolved.max_model_len
        self.executor = Executor(config)
        self.runner = self.executor.runner  # rank 0's
        sizes = self.executor.driver.sizes
        self.kv_bytes_per_block = sizes.bytes_per_block
        self.kv = KVCacheManager(sizes.num_blocks, self.resolved.block_size,
                                 config.enable_prefix_caching, sizes.num_host_blocks)
        self.scheduler = Scheduler(config.scheduler_config(self.resolved), self.kv)
        self.eos_token_ids = loader.eos_token_ids(source, self.arch, self.tokenizer)
        self.limits = InputLimits(self.arch.vocab_size, self.max_model_len, config.max_num_seqs,
                                  self.eos_token_ids, sizes.num_blocks, self.resolved.block_size)
        self.inputs = InputProcessor(self.tokenizer, self.limits, self.runner.device)
        self.outputs = OutputProcessor(self.scheduler.finish,
                                       BeamDriver(self.scheduler, self.tokenizer))
        self._in_flight: StepResult | None = None  # the queued step not yet applied
        self._num_prompt_tokens = 0
        self._next_id = 0
        logger.info(
            "engine ready in %.1fs: platform=%s model=%s (%s) dtype=%s max_model_len=%d "
            "kv_blocks=%d x %d tokens = %d concurrent tokens",
            time.perf_counter() - start, self.platform.name, self.model_name, source.origin,
            str(self.dtype).removeprefix("torch."), self.max_model_len, sizes.num_blocks,
            self.resolved.block_size, sizes.num_blocks * self.resolved.block_size)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; ``request_id`` may be any string not in use (default: a counter).
        Raises ``ValueError`` for input the engine cannot run."""
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        state = self.inputs.process(request_id, prompt, params or SamplingParams())
        self.scheduler.add_group(state.group)
        self.outputs.add(state)
        return request_id

    def abort_request(self, request_id: str) -> None:
        state = self.outputs.pop(request_id)
        if state is None:
            return
        for seq in state.seqs:
            self.scheduler.finish(seq.seq, SequenceStatus.FINISHED_ABORTED)
        if not self.outputs.requests:
            self._in_flight = None  # it computes for aborted requests only

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests)

    def dead_reason(self) -> str | None:
        """Why the engine cannot step any more (a tensor-parallel rank died), or None."""
        return self.executor.dead_reason()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one)."""
        self.executor.shutdown()

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, process outputs. Under async scheduling the outputs processed are
        the previous step's, while this one computes."""
        run_ahead = self.resolved.async_scheduling and not self.outputs.num_step_by_step
        if self._in_flight is not None and not run_ahead:
            return self._process(self._take_in_flight())  # settle before a synchronous step
        out = self.scheduler.schedule(schedule_pending=run_ahead)
        if out.is_empty:
            # Nothing runs, but preempted sequences' blocks must still reach the swap pool.
            self.executor.apply_block_ops(out.block_ops)
            return self._process(self._take_in_flight()) if self._in_flight is not None else []
        result = self._run(out)
        if not run_ahead:
            return self._process(result)
        previous, self._in_flight = self._in_flight, result
        return self._process(previous) if previous is not None else []

    def _run(self, out: SchedulerOutput) -> StepResult:
        """Queue the step's forward pass and mark its tokens computed."""
        self._record_first_scheduled(out)
        previous = self._in_flight
        result = self.executor.execute(out, self._sampling_metadata(out),
                                       previous.in_flight_tokens() if previous else None)
        self.scheduler.advance(out)
        self._num_prompt_tokens += sum(
            max(0, min(s.num_new_tokens, s.seq.num_prompt_tokens - s.num_computed_tokens))
            for s in out.scheduled)
        return result

    def _process(self, result: StepResult) -> list[RequestOutput]:
        samples = self.runner.fetch_samples(result) if result.sampler_output is not None \
            else None
        outputs = self.outputs.process(result, samples)
        if not self.outputs.requests:
            # Everything the step in flight computes belongs to finished requests.
            self._in_flight = None
        return outputs

    def _take_in_flight(self) -> StepResult:
        result, self._in_flight = self._in_flight, None
        return result

    def _record_first_scheduled(self, out: SchedulerOutput) -> None:
        now = time.time()
        for item in out.scheduled:
            state = self.outputs.sequence(item.seq).request
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                state.metrics.num_cached_tokens = item.seq.num_cached_tokens

    def _sampling_metadata(self, out: SchedulerOutput) -> SamplingMetadata | None:
        rows = [self.outputs.sequence(s.seq) for s in out.scheduled if s.samples]
        if not rows:
            return None
        meta = SamplingMetadata.build(
            params=[r.seq.params for r in rows],
            prompt_token_ids=[r.seq.prompt_token_ids for r in rows],
            output_token_ids=[r.seq.output_token_ids for r in rows],
            generators=[r.generator for r in rows],
            eos_token_ids=sorted(self.eos_token_ids),
            vocab_size=self.arch.vocab_size,
            device=self.runner.device,
        )
        # Beams read their candidates from the top-k logprobs.
        meta.max_num_logprobs = max(meta.max_num_logprobs, max(
            (r.request.beam.search.num_candidates for r in rows if r.request.beam is not None),
            default=0))
        return meta

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        allocated, filled = self.scheduler.kv_waste_slots()
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=pool.num_blocks,
            blocks_used=pool.num_used,
            blocks_free=pool.num_free,
            kv_usage=self.kv.usage(),
            kv_allocated_slots=allocated,
            kv_filled_slots=filled,
            prefix_queried_tokens=self.kv.prefix_stats.queried_tokens,
            prefix_hit_tokens=self.kv.prefix_stats.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self.outputs.num_generation_tokens,
            num_swapped=len(self.scheduler.swapped),
            blocks_shared=pool.num_shared,
            process_cpu_s=time.process_time(),
        )
