"""The engine: add requests, call ``step`` until done, read ``RequestOutput``s.

A request passes three stages, each a module of its own:

1. ``input_processor``: validate and tokenize; build the core's ``SequenceGroup`` and the
   engine's ``RequestState``.
2. the core step, here: the scheduler picks the tokens to compute (``core/scheduler``), the
   executor runs them on every rank and rank 0 samples (``executor``, over ``worker/``), the
   scheduler marks them done.
3. ``output_processor``: append the sampled tokens, detokenize, check stops, record logprobs,
   let the beam driver pick beams (``beam_driver``), build ``RequestOutput``s.

Async scheduling (default where the platform's host runs ahead of the device): a step queues
its forward pass, then applies the previous step's tokens while the device computes, so the
host's per-step work hides behind the device's. The step after is scheduled before the host
has seen those tokens; a sequence then takes its next input from the previous step's output on
the device, and a sequence that turns out to have stopped wastes one step, whose token is
dropped. Requests whose next logits depend on the host's view of earlier tokens (penalties,
min_tokens, bad words, beam search, prompt logprobs) switch the engine back to one step at a time. A
grammar's mask needs that view too, but only for sampling: while a constrained row samples, a
step queues its forward pass, applies the previous step's tokens (advancing the grammars)
while the device computes, and only then builds the masks and queues the sampler. A forbidden
token can never be drawn, and a sequence found stopped has its extra token dropped as usual.

Structured output: a constrained request waits outside the scheduler until its grammar is
compiled (in a worker process, ``structured/compiler``); the others keep running meanwhile.
"""

from __future__ import annotations

import atexit
import gc
import time
import weakref
from collections.abc import Sequence, Set
from concurrent.futures import FIRST_COMPLETED, Future, wait

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.core.sequence import Sequence as CoreSequence
from pagedserve.core.sequence import SequenceStatus
from pagedserve.engine.beam_driver import BeamDriver
from pagedserve.engine.input_processor import InputLimits, InputProcessor
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.request_state import RequestState
from pagedserve.engine.speculation import Speculation, check_draft_tokenizer
from pagedserve.engine.stats import EngineStats
from pagedserve.errors import ConfigError, EngineSleepingError
from pagedserve.executor.executor import Executor
from pagedserve.logger import get_logger
from pagedserve.lora.host_adapters import HostAdapters
from pagedserve.lora.request import LoRARequest
from pagedserve.models import loader
from pagedserve.models.generation_defaults import sampling_defaults
from pagedserve.models.rotary import longrope_original_length
from pagedserve.outputs import RequestOutput
from pagedserve.platforms import resolve_platform
from pagedserve.pooling_params import PoolingParams
from pagedserve.sample.logits_processor import qualified_name
from pagedserve.sampling_params import (
    InvalidSamplingParam,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedserve.structured.grammar_state import (
    GrammarState,
    ReasoningGate,
    build_grammar_mask,
)
from pagedserve.structured.spec import grammar_spec
from pagedserve.worker.step import Forward, SamplingInputs, StepResult

logger = get_logger(__name__)

# How long an otherwise idle step waits for a grammar to compile, instead of spinning.
_GRAMMAR_WAIT_S = 0.02
# How long an otherwise idle step waits for a KV block read from disk.
_DISK_WAIT_S = 0.02

class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.data_parallel_size > 1:
            # vLLM's offline data parallelism is one process per replica, each its own LLM;
            # the server runs the replicas itself.
            raise ConfigError(
                f"--data-parallel-size {config.data_parallel_size}: an in-process engine (LLM, "
                "the benchmarks) is one replica; serve the replicas with `pagedserve serve "
                "--data-parallel-size N`, or run one LLM per process, each given its devices")
        self.config = config
        start = time.perf_counter()
        self.platform = resolve_platform(config.device)
        source = loader.resolve_model(config.model, config.load_format != "dummy",
                                      revision=config.revision, gguf_file=config.gguf_file)
        self.model_name = config.served_model_name or source.name
        self.arch = loader.load_arch_config(source, config.hf_overrides)
        # --runner auto and --pooler-config resolved for this checkpoint, once, for every rank.
        config = self.config = config.for_checkpoint(
            self.arch, loader.sentence_transformers_pooling(source))
        self.tokenizer = loader.load_model_tokenizer(source, self.arch, config.tokenizer,
                                                     config.tokenizer_revision,
                                                     config.chat_template)
        self.sampling_defaults = sampling_defaults(config.generation_config, source.path,
                                                   config.override_generation_config)
        if config.speculative_config is not None:
            check_draft_tokenizer(config.speculative_config, self.tokenizer, config.load_format)
        self.resolved = config.resolve(self.arch, self.platform)
        self.dtype = self.resolved.dtype
        self.max_model_len = self.resolved.max_model_len
        self.executor = Executor(config, config.layer_split(self.arch))
        sizes = self.executor.kv_sizes
        fitted = config.fit_kv_cache(self.resolved, sizes.num_blocks * self.resolved.block_size)
        if fitted.max_model_len < self.max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than the model's context length "
                           "(%d): max_model_len lowered to %d (give the cache more memory to "
                           "keep it)", fitted.max_model_len, self.max_model_len,
                           fitted.max_model_len)
        self.resolved, self.max_model_len = fitted, fitted.max_model_len
        self.kv_bytes_per_block = sizes.bytes_per_block
        self.kv = KVCacheManager(sizes.num_blocks, self.resolved.block_size,
                                 config.prefix_caching, sizes.num_host_blocks,
                                 sizes.num_offload_blocks, sizes.num_disk_blocks,
                                 self.executor.stored_disk_blocks())
        self.scheduler = Scheduler(config.scheduler_config(self.resolved), self.kv)
        self.eos_token_ids = loader.eos_token_ids(source, self.arch, self.tokenizer)
        self.limits = InputLimits(self.arch.vocab_size, self.max_model_len, config.max_num_seqs,
                                  self.eos_token_ids, sizes.num_blocks, self.resolved.block_size,
                                  config.max_grammar_bytes, config.max_logprobs,
                                  speculative=config.speculative_config is not None,
                                  logits_processors=tuple(map(qualified_name,
                                                              config.logits_processors)),
                                  runner="pooling" if config.pooling else "generate",
                                  hidden_size=self.arch.hidden_size,
                                  is_matryoshka=self.arch.is_matryoshka,
                                  matryoshka_dimensions=self.arch.matryoshka_dimensions,
                                  num_labels=self.arch.num_labels,
                                  scheduling_policy=config.scheduling_policy,
                                  long_rope_after=longrope_original_length(
                                      self.arch.rope_scaling))
        self.adapters = (HostAdapters(config.max_lora_rank, self.arch, config.cpu_loras)
                         if config.enable_lora else None)
        self.inputs = InputProcessor(self.tokenizer, self.limits,
                                     self._admit_adapter if config.enable_lora else None)
        self.outputs = OutputProcessor(self.scheduler.finish, self.scheduler.take_back,
                                       BeamDriver(self.scheduler, self.tokenizer))
        self.speculation = (Speculation(config.speculative_config)
                            if config.speculative_config is not None else None)
        self._in_flight: StepResult | None = None  # the queued step not yet applied
        self._grammars = None  # GrammarCompilerPool, made at the first constrained request
        # Constrained requests whose grammar is still compiling, by id.
        self._awaiting_grammar: dict[str, tuple[RequestState, Future]] = {}
        # The last step's requests whose grammar was refused (over the compile budget): each
        # also finished with an error output; the core process answers them with a 400.
        self.refused: dict[str, InvalidSamplingParam] = {}
        # Requests that failed before they were scheduled (a grammar that did not compile, an
        # adapter that could not be read again), already out of ``outputs``, and the refused
        # among them (grammars over the compile budget): reported by the next ``step`` that
        # returns (a step that raises keeps them).
        self._failures: list[RequestOutput] = []
        self._refusing: dict[str, InvalidSamplingParam] = {}
        self._num_prompt_tokens = 0
        self._next_id = 0
        self._shut_down = False
        if config.enable_sleep_mode and not self.platform.supports_sleep_mode:
            raise ConfigError(f"--enable-sleep-mode is not supported on {self.platform.name}")
        self._asleep: set[str] = set()  # sleep mode: "weights", "kv_cache" while freed
        logger.info(
            "engine ready in %.1fs: platform=%s model=%s (%s) dtype=%s max_model_len=%d "
            "kv_blocks=%d x %d tokens = %d concurrent tokens",
            time.perf_counter() - start, self.platform.name, self.model_name, source.origin,
            str(self.dtype).removeprefix("torch."), self.max_model_len, sizes.num_blocks,
            self.resolved.block_size, sizes.num_blocks * self.resolved.block_size)
        _freeze_startup_heap()

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int],
                    params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> str:
        """Queue a request; ``request_id`` may be any string not in use (default: a counter).
        ``PoolingParams`` (with ``--runner pooling``) make it an embedding request.
        ``priority`` (``--scheduling-policy priority``): lower is served earlier. Raises
        ``ValueError`` for input the engine cannot run."""
        if request_id is None:
            request_id = self._new_id()
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._queue(self.inputs.process(request_id, prompt, params or SamplingParams(),
                                        lora_request, priority))
        return request_id

    def add_requests(self, prompts: Sequence[str | list[int]],
                     params: Sequence[SamplingParams | PoolingParams],
                     lora_requests: Sequence[LoRARequest | None] | None = None,
                     priorities: Sequence[int] | None = None) -> list[str]:
        """Queue a batch as a whole, or none of it: every request is validated before any is
        queued, and one that fails to queue takes back those queued before it."""
        loras = [None] * len(prompts) if lora_requests is None else lora_requests
        priorities = [0] * len(prompts) if priorities is None else priorities
        states = [self.inputs.process(self._new_id(), prompt, p, lora, priority)
                  for prompt, p, lora, priority in zip(prompts, params, loras, priorities,
                                                       strict=True)]
        queued: list[str] = []
        try:
            for state in states:
                self._queue(state)
                queued.append(state.request_id)
        except BaseException:
            for request_id in queued:
                self.abort_request(request_id)
            raise
        return queued

    def _new_id(self) -> str:
        """The counter's next id that no request in flight has: a caller's own id may be one
        the counter has not reached yet."""
        while str(self._next_id) in self.outputs.requests:
            self._next_id += 1
        self._next_id += 1
        return str(self._next_id - 1)

    def _queue(self, state: RequestState) -> None:
        """Hand a validated request to the scheduler (or the grammar compiler first); what can
        fail comes before it is recorded, so a failure leaves nothing to take back."""
        if self._shut_down:
            raise RuntimeError("the engine was shut down")
        if self._asleep:
            raise EngineSleepingError("the engine is asleep (sleep mode): call wake_up() "
                                      "before adding requests")
        structured = state.params.structured_outputs
        if structured is None:
            self.scheduler.add_group(state.group)
        else:
            future = self.grammars.get(grammar_spec(structured))
            self._awaiting_grammar[state.request_id] = (state, future)
        self.outputs.add(state)

    @property
    def grammars(self):
        """The grammar compiler (``structured.compiler.GrammarCompilerPool``)."""
        if self._grammars is None:
            from pagedserve.structured.compiler import GrammarCompilerPool

            self._grammars = GrammarCompilerPool(
                self.tokenizer, self.arch.vocab_size, self.eos_token_ids,
                num_workers=self.config.grammar_compile_workers,
                timeout_s=self.config.max_grammar_compile_seconds)
            # Its threads keep the pool alive; a dropped engine must still stop its workers.
            weakref.finalize(self, self._grammars.close)
        return self._grammars

    def _admit_adapter(self, lora_request: LoRARequest) -> str:
        """The adapter's content hash: read from its folder now unless every rank holds it,
        and handed to them if there is room (else read again before it starts), so no step
        reads a folder (``lora/host_adapters.py``)."""
        try:
            admitted = self.adapters.admit(lora_request)
        except ValueError as exc:  # the request's fault, named by its argument (a 400)
            raise InvalidSamplingParam("lora_request", str(exc)) from exc
        if admitted.adapter is not None:
            self.executor.add_lora(lora_request.lora_int_id, admitted.adapter)
        return admitted.key

    def _hold_adapters(self) -> Set[int] | None:
        """Make room in host memory for the adapters of waiting requests, reading them now,
        before the step (``lora/host_adapters.py``); the adapters whose waiting requests may
        start (None: LoRA is off)."""
        if self.adapters is None:
            return None
        plan = self.adapters.plan(self.scheduler.waiting_loras(), self.scheduler.loras_in_use())
        self.adapters.drop(plan.drop)
        for lora_int_id in plan.drop:
            self.executor.remove_lora(lora_int_id)
        for request in plan.load:
            try:
                adapter = self.adapters.hold(request)
            except ValueError as exc:
                self._fail_waiting(request.lora_int_id, str(exc))
                continue
            self.executor.add_lora(request.lora_int_id, adapter)
            # Read again, the folder may hold other weights: the key follows them.
            for group in self.scheduler.waiting_of(request.lora_int_id):
                for seq in group.seqs + group.pending_forks:
                    seq.cache_key = adapter.content_hash
        return self.adapters.startable()

    def _fail_waiting(self, lora_int_id: int, why: str) -> None:
        """Finish with an error the waiting requests of an adapter that cannot be read again
        (its folder vanished since they were admitted); the next step returns them."""
        for group in self.scheduler.waiting_of(lora_int_id):
            logger.error("request %s: its LoRA adapter %s", group.request_id, why)
            state = self.outputs.pop(group.request_id)
            for seq in group.seqs + group.pending_forks:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
            self._failures.append(state.to_output())

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter no request runs with any more: its content hash here, its host
        copy and device slot on every rank (a later request of that id reads its folder
        again). The slot's weights stay where they are until another adapter is written
        there, so a step already queued on the device still reads them."""
        if self.adapters is not None:
            self.adapters.forget(lora_int_id)
            self.executor.remove_lora(lora_int_id)

    def abort_request(self, request_id: str) -> None:
        state = self.outputs.pop(request_id)
        if state is None:
            return
        awaiting = self._awaiting_grammar.pop(request_id, None)
        if awaiting is not None:
            self.grammars.release(awaiting[1])  # the last to leave stops the compile
            _mark_finished(state, SequenceStatus.FINISHED_ABORTED)  # it holds no blocks yet
            return
        for seq in state.seqs:
            self.scheduler.finish(seq.seq, SequenceStatus.FINISHED_ABORTED)
        if not self.outputs.requests:
            self._in_flight = None  # it computes for aborted requests only

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests or self._failures)

    def dead_reason(self) -> str | None:
        """Why the engine cannot step any more (a tensor-parallel rank died), or None."""
        return self.executor.dead_reason()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave their process group; the engine
        takes no request after this. Idempotent; dropping the engine does the same."""
        self._shut_down = True
        if self._grammars is not None:
            self._grammars.close()
        self.executor.shutdown()

    # ---- sleep mode and weight updates (worker/sleep.py) ---------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, so that no later request reuses KV computed
        before (after new weights). False, and nothing done, while requests are in flight
        (vLLM's rule) or with a KV offloading tier."""
        if self.has_unfinished_requests() or self._awaiting_grammar or self._in_flight:
            return False
        return self.kv.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the device for a while (``--enable-sleep-mode``): level 1 moves the weights
        to host memory, level 2 discards them (load new ones before use); both free the KV
        pool, whose contents are lost. ``RuntimeError`` while requests are in flight."""
        self._check_sleep_mode("sleep")
        if self.has_unfinished_requests() or self._awaiting_grammar:
            raise RuntimeError("cannot sleep while requests are running: wait for them to "
                               "finish or abort them")
        self._in_flight = None
        self.executor.sleep(level)
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what ``tags`` name ("weights", "kv_cache"; None: both). The KV pool
        comes back empty, so the prefix cache is reset; the engine takes requests again once
        both are back."""
        self._check_sleep_mode("wake_up")
        woken = self.executor.wake_up(tags)
        if "kv_cache" in woken and "kv_cache" in self._asleep:
            self.kv.reset_prefix_cache()
        self._asleep.difference_update(woken)

    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def load_weights(self, weights) -> None:
        """Load new weights into the model on every rank: (name, tensor) pairs under the
        checkpoint's (Hugging Face) names, each rank keeping its tensor-parallel slice; then
        reset the prefix cache, whose blocks the old weights computed. With the weights
        asleep at level 2, wake them up first (``wake_up(["weights"])``)."""
        if "weights" in self._asleep:
            raise EngineSleepingError("the weights are asleep: call wake_up(['weights']) "
                                      "before loading weights")
        if self.has_unfinished_requests() or self._awaiting_grammar:
            raise RuntimeError("cannot load weights while requests are running")
        self._in_flight = None
        self.executor.load_weights(list(weights))
        if not self.kv.reset_prefix_cache():
            logger.warning("load_weights: the KV offloading tier keeps blocks the old weights "
                           "computed; later prompts may reuse them")

    def _check_sleep_mode(self, call: str) -> None:
        if not self.config.enable_sleep_mode:
            raise ConfigError(f"{call}: sleep mode is off; start the engine with "
                              "--enable-sleep-mode (LLM(enable_sleep_mode=True))")

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit the requests whose grammar is ready, then schedule, run, process outputs.
        Under async scheduling the outputs processed are the previous step's, while this one
        computes."""
        if self._awaiting_grammar:
            self._admit_compiled()
        outputs = self._step()
        failed, self._failures = self._failures, []
        self.refused, self._refusing = self._refusing, {}
        return failed + outputs

    def _admit_compiled(self) -> None:
        """Schedule the constrained requests whose grammar is compiled, each sequence with
        its own matcher; a request whose grammar failed finishes with an error, its output
        kept for the step to return."""
        if not self.scheduler.has_unfinished and self._in_flight is None:
            wait([f for _, f in self._awaiting_grammar.values()], timeout=_GRAMMAR_WAIT_S,
                 return_when=FIRST_COMPLETED)
        for request_id, (state, future) in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[request_id]
            if future.exception() is not None:
                logger.error("grammar of request %s failed to compile: %s", request_id,
                             future.exception())
                if isinstance(future.exception(), InvalidSamplingParam):
                    self._refusing[request_id] = future.exception()
                self.outputs.pop(request_id)
                _mark_finished(state, SequenceStatus.FINISHED_ERROR)
                self._failures.append(state.to_output())
                continue
            gate = _reasoning_gate(state.params.structured_outputs)
            for seq in state.seqs:
                seq.grammar = GrammarState(future.result(), gate)
            self.scheduler.add_group(state.group)

    def _step(self) -> list[RequestOutput]:
        proposes = self.speculation is not None and \
            self.speculation.proposes(self.scheduler.running)
        run_ahead = (self.resolved.async_scheduling and not self.outputs.num_step_by_step
                     and not proposes)
        if self._in_flight is not None and not run_ahead:
            return self._process(self._take_in_flight())  # settle before a synchronous step
        self._finish_disk_reads()
        if proposes:  # the host has seen every token
            self.speculation.propose(self.scheduler.running,
                                     self.resolved.max_num_batched_tokens, self._grammar_of)
        out = self.scheduler.schedule(schedule_pending=run_ahead,
                                      startable_loras=self._hold_adapters())
        if out.is_empty:
            # Nothing runs, but preempted sequences' blocks must still reach the swap pool.
            self.executor.apply_block_ops(out.block_ops)
            return self._process(self._take_in_flight()) if self._in_flight is not None else []
        if not run_ahead:
            return self._run_now(out)
        previous = self._in_flight
        if previous is not None and _samples_with_grammar(out):
            return self._run_masked_ahead(out, previous)
        self._in_flight = self._run(out)
        return self._process(previous) if previous is not None else []

    def _run_now(self, out: SchedulerOutput) -> list[RequestOutput]:
        """A step run and applied before the next is scheduled, timed for the drafts'
        policy (its cost per token)."""
        start = time.perf_counter()
        outputs = self._process(self._run(out))
        if self.speculation is not None:
            self.speculation.record_step(out.num_batched_tokens,
                                         any(s.draft_token_ids for s in out.scheduled),
                                         time.perf_counter() - start)
        return outputs

    def _finish_disk_reads(self) -> None:
        """Hand the KV offloading tier's finished disk reads to the KV manager; when nothing
        else is left to run, wait a moment for one instead of spinning."""
        offload = self.kv.offload
        if offload is None or not offload.num_loading:
            return
        idle = not self.scheduler.running and self._in_flight is None
        self.kv.finish_disk_reads(self.executor.finished_disk_reads(
            _DISK_WAIT_S if idle else 0.0))

    def _run_masked_ahead(self, out: SchedulerOutput, previous: StepResult
                          ) -> list[RequestOutput]:
        """Run ahead with grammar masks: the previous step's tokens are applied between this
        step's forward pass and its sampling, so every mask sees every token before it."""
        forward = self._queue_forward(out)
        self._in_flight = None
        outputs = self._process(previous)
        result = self._queue_sampling(forward)
        # Tokens of requests finished meanwhile are dropped when this result is processed.
        self._in_flight = result if self.outputs.requests else None
        return outputs

    def _run(self, out: SchedulerOutput) -> StepResult:
        """Queue the step's forward pass and sampling, and mark its tokens computed."""
        self._record_first_scheduled(out)
        result = self.executor.execute(out, self._sampling_inputs(out))
        self._advance(out)
        return result

    def _queue_forward(self, out: SchedulerOutput) -> Forward:
        """``_run`` without the sampling (``_queue_sampling``), for masks built meanwhile."""
        self._record_first_scheduled(out)
        forward = self.executor.forward(out)
        self._advance(out)
        return forward

    def _queue_sampling(self, forward: Forward) -> StepResult:
        return self.executor.sample(forward, self._sampling_inputs(forward.out))

    def _advance(self, out: SchedulerOutput) -> None:
        self.scheduler.advance(out)
        self._num_prompt_tokens += out.num_prompt_tokens

    def _process(self, result: StepResult) -> list[RequestOutput]:
        output = self.executor.fetch(result)
        outputs = self.outputs.process(result, output)
        if self.speculation is not None:
            self.speculation.record(result, output.samples)
        if not self.outputs.requests:
            # Everything the step in flight computes belongs to finished requests.
            self._in_flight = None
        return outputs

    def _grammar_of(self, seq: CoreSequence) -> GrammarState | None:
        state = self.outputs.find(seq)
        return None if state is None else state.grammar

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

    def _sampling_inputs(self, out: SchedulerOutput) -> SamplingInputs | None:
        """What rank 0's sampling batch cannot read from the sequences: the grammar masks and
        the beams' candidate count. A sequence whose request has finished since it was
        scheduled (its token will be dropped) samples with its row's settings, no grammar."""
        sampling = [s for s in out.scheduled if s.num_sample_positions]
        if not sampling:
            return None
        if not self.outputs.num_with_sampling_inputs:  # no grammar, no beams: nothing to add
            return SamplingInputs(None, 0)
        rows = [self.outputs.find(s.seq) for s in sampling]
        # A mask row per position: a verifying sequence's position j is masked as after its
        # first j drafts (walked through its matcher and taken back, so none advances it;
        # the output stage advances it by the tokens the step keeps).
        grammar_mask = build_grammar_mask(
            [r.grammar if r is not None and not r.finished else None for r in rows],
            self.arch.vocab_size, [s.draft_token_ids for s in sampling])
        # Beams read their candidates from the top-k logprobs.
        return SamplingInputs(grammar_mask, max(
            (r.request.beam.search.num_candidates for r in rows
             if r is not None and r.request.beam is not None), default=0))

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        allocated, filled = self.scheduler.kv_waste_slots()
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            # A request whose grammar compiles waits too, outside the scheduler.
            num_waiting=len(self.scheduler.waiting) + len(self._awaiting_grammar),
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
            **self._spec_stats(),
            **self._offload_stats(),
        )

    def _offload_stats(self) -> dict[str, int | float]:
        if self.kv.offload is None:
            return {}
        s, per_block = self.kv.offload.stats, self.kv_bytes_per_block
        return dict(
            prefix_host_hit_tokens=s.host_hits * self.kv.block_size,
            prefix_disk_hit_tokens=s.disk_hits * self.kv.block_size,
            offload_host_hits=s.host_hits, offload_host_misses=s.host_misses,
            offload_disk_hits=s.disk_hits, offload_disk_misses=s.disk_misses,
            offload_bytes_to_host=s.blocks_to_host * per_block,
            offload_bytes_to_device=s.blocks_to_device * per_block,
            offload_bytes_to_disk=s.blocks_to_disk * per_block,
            offload_bytes_from_disk=s.blocks_from_disk * per_block,
            offload_copy_s=self.executor.kv_copy_seconds(),
        )

    def _spec_stats(self) -> dict:
        if self.speculation is None:
            return {}
        c = self.speculation.counters
        return {"spec_num_drafts": c.num_drafts, "spec_num_draft_tokens": c.num_draft_tokens,
                "spec_num_accepted_tokens": c.num_accepted_tokens,
                "spec_accepted_per_position": tuple(c.accepted_per_position)}


def _freeze_startup_heap() -> None:
    """Take what start-up left (modules, the model's parameters, the tokenizer: some 340,000
    objects with a small model) out of the cycle collector's view, as vLLM does after its
    warm-up: each oldest-generation collection that the step loop's allocations trigger then
    walks only what was made since, instead of pausing the step for all of it. Garbage is
    collected first, so none is kept for good. Process-wide, like the collector itself."""
    gc.collect()
    if not gc.get_freeze_count():
        # Handed back at exit, once per process, so the last collection still frees the
        # frozen cycles (extension modules such as triton's report what it never frees).
        atexit.register(gc.unfreeze)
    gc.freeze()


def _reasoning_gate(structured: StructuredOutputsParams) -> ReasoningGate | None:
    """When the grammar starts to apply: after the reasoning, if the request says so."""
    if structured.reasoning_end_token_ids is None:
        return None
    return ReasoningGate(tuple(structured.reasoning_end_token_ids),
                         structured.reasoning_start_token_id)


def _samples_with_grammar(out: SchedulerOutput) -> bool:
    return any(s.num_sample_positions and s.seq.params.structured_outputs is not None
               for s in out.scheduled)


def _mark_finished(state: RequestState, status: SequenceStatus) -> None:
    """Finish a request that never reached the scheduler."""
    for seq in state.seqs:
        seq.seq.status = status
