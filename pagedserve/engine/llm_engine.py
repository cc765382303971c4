"""The synchronous engine: add requests, call ``step`` until done, read ``RequestOutput``s.

One step = schedule -> run the model -> apply the sampled tokens (stop checks, detokenizing,
freeing finished requests' blocks). Everything device-specific sits behind the platform.

Async scheduling (default where the platform's host runs ahead of the device): a step queues
its forward pass, then applies the previous step's tokens while the device computes, so the
host's per-step work hides behind the device's. The step after is scheduled before the host
has seen those tokens; a stream then takes its next input from the previous step's output on
the device, and a stream that turns out to have stopped wastes one step, whose token is
dropped. Requests whose next logits depend on the host's view of earlier tokens (penalties,
min_tokens, beam search, prompt logprobs) switch the engine back to one step at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import NamedTuple

import torch

from pagedserve.config import ConfigError, EngineConfig
from pagedserve.core.beam_search import BeamCandidates, BeamContinuation, BeamSearch
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus, SequenceGroup
from pagedserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.model_runner import KVCacheSpec, ModelRunner, StepResult
from pagedserve.engine.request_state import (
    RequestState,
    SequenceState,
    beam_completion,
    token_logprobs,
)
from pagedserve.engine.stats import EngineStats
from pagedserve.engine.stop_conditions import stop_status
from pagedserve.logger import get_logger
from pagedserve.models import loader
from pagedserve.outputs import RequestMetrics, RequestOutput
from pagedserve.platforms import resolve_platform
from pagedserve.sample.metadata import SamplingMetadata, check_token_ids
from pagedserve.sample.sampler import SamplerOutput
from pagedserve.sample.seeds import stream_seed
from pagedserve.sampling_params import InvalidSamplingParam, SamplingParams

logger = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class PromptTooLong(InvalidSamplingParam):
    """The prompt leaves no room to generate within the context window, or the request could
    not fit the KV pool; ``param`` names what to shorten (``prompt`` or ``max_tokens``)."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        self.platform = resolve_platform(config.device)
        self.platform.seed_everything(config.seed)
        source = loader.resolve_model(config.model,
                                      require_weights=config.load_format != "dummy")
        self.model_name = config.served_model_name or source.name
        self.arch = loader.load_arch_config(source)
        self.tokenizer = loader.load_tokenizer(source)
        self.generation_config = loader.load_generation_config(source)
        self.dtype = self._resolve_dtype()
        self.max_model_len = self._resolve_max_model_len()
        self.runner = ModelRunner(self.platform, self.arch, self.dtype, self.max_model_len,
                                  config.kv_cache_dtype)
        if config.load_format == "dummy":
            self.runner.init_dummy_weights(config.seed)
        else:
            self.runner.load_weights(loader.iter_weights(source))
        num_blocks = self._num_kv_blocks()
        self.runner.allocate_kv_cache(
            KVCacheSpec(num_blocks, config.block_size, self.runner.kv_dtype))
        if not config.enforce_eager:
            self.runner.capture_graphs(config.max_num_seqs)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 num_host_blocks=self._num_swap_blocks())
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.resolved_max_num_batched_tokens(self.max_model_len),
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
        ), self.kv)
        self.eos_token_ids = self._eos_token_ids()
        self.async_scheduling = (self.platform.runs_ahead if config.async_scheduling is None
                                 else config.async_scheduling)
        self._in_flight: StepResult | None = None  # the queued step not yet applied
        self._num_step_by_step = 0  # unfinished requests that need synchronous steps
        self._states: dict[str, RequestState] = {}
        self._seqs: dict[str, SequenceState] = {}
        self._prompt_tokens = self._generation_tokens = 0
        self._next_id = 0
        self._fork_ids = itertools.count(1)
        logger.info(
            "engine ready in %.1fs: platform=%s model=%s (%s) dtype=%s max_model_len=%d "
            "kv_blocks=%d x %d tokens = %d concurrent tokens",
            time.perf_counter() - start, self.platform.name, self.model_name, source.origin,
            str(self.dtype).removeprefix("torch."), self.max_model_len, num_blocks,
            config.block_size, num_blocks * config.block_size)

    # ---- set-up -------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        spec = KVCacheSpec(1, self.config.block_size, self.runner.kv_dtype)
        return spec.bytes_per_block(self.arch)

    def _resolve_dtype(self) -> torch.dtype:
        if self.config.dtype == "auto":
            return self.platform.default_dtype()
        return _DTYPES[self.config.dtype]

    def _resolve_max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        if self.arch.sliding_window and self.arch.sliding_window < limit:
            # Sliding-window attention is not implemented: stay inside one window.
            limit = self.arch.sliding_window
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ConfigError(f"--max-model-len {wanted} exceeds the model's limit of {limit}")
        return wanted

    def _num_kv_blocks(self) -> int:
        per_block = self.kv_bytes_per_block
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            budget = self.platform.kv_cache_budget_bytes(
                self.config.gpu_memory_utilization, self._peak_memory_bytes())
            # Never reserve more than every sequence at full length could use.
            useful = self.config.max_num_seqs * (self.max_model_len + self.config.block_size)
            budget = min(budget, useful // self.config.block_size * per_block)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; "
                "raise --kv-cache-memory-bytes or --gpu-memory-utilization")
        return int(num_blocks)

    def _peak_memory_bytes(self) -> int:
        """Weights plus the activations of the largest step, measured where the platform can."""
        if not self.platform.profiles_memory:
            return self.runner.weight_bytes()
        budget = self.config.resolved_max_num_batched_tokens(self.max_model_len)
        peak = self.runner.profile_peak_memory(budget, self.config.max_num_seqs,
                                               self.config.block_size)
        logger.info("memory profile: weights %.2f GiB, peak with activations %.2f GiB",
                    self.runner.weight_bytes() / 2**30, peak / 2**30)
        return peak

    def _num_swap_blocks(self) -> int:
        """Blocks of --swap-space, but never more than every sequence at full length."""
        useful = self.config.max_num_seqs * (self.max_model_len // self.config.block_size + 1)
        return min(int(self.config.swap_space * 2**30) // self.kv_bytes_per_block, useful)

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set(self.arch.eos_token_ids)
        gen_eos = self.generation_config.get("eos_token_id")
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None
                   else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self._check_prompt(token_ids, params)
        # A bad id inside a batched scatter would fail the whole step, so reject it here.
        check_token_ids(params, self.arch.vocab_size)
        state = RequestState(request_id, text, token_ids, params,
                             RequestMetrics(arrival_time=time.time()),
                             beam=self._beam_search(params, max_tokens))
        # Beam search starts from one stream; parallel sampling forks best_of from the prompt.
        num_streams = 1 if state.beam is not None else params.best_of
        requests = [
            Request(request_id if params.best_of == 1 else f"{request_id}#{i}", token_ids,
                    self._stream_params(params), max_tokens, self.eos_token_ids)
            for i in range(num_streams)
        ]
        for i, request in enumerate(requests):
            state.seqs.append(self._add_seq(state, request, i))
        self.scheduler.add_group(SequenceGroup(requests[:1], width=params.best_of,
                                               pending_forks=requests[1:]))
        self._states[request_id] = state
        self._num_step_by_step += not _can_run_ahead(params)
        return request_id

    def _add_seq(self, state: RequestState, request: Request, index: int) -> SequenceState:
        params = state.params
        seq = SequenceState(
            index=index, request=request,
            detokenizer=IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, params),
            generator=self._generator(params, index),
            logprobs=[] if params.logprobs is not None and state.beam is None else None,
            beam_candidates=state.beam.num_candidates if state.beam is not None else 0)
        self._seqs[request.request_id] = seq
        return seq

    def _beam_search(self, params: SamplingParams, max_tokens: int) -> BeamSearch | None:
        if not params.use_beam_search:
            return None
        stops = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.eos_token_ids
        return BeamSearch(params.best_of, max_tokens, stops, params.length_penalty,
                          params.early_stopping)

    def _stream_params(self, params: SamplingParams) -> SamplingParams:
        """Beams are scored from their logprobs, so their rows sample greedily and cheaply."""
        if not params.use_beam_search:
            return params
        return dataclasses.replace(params, temperature=0.0, logprobs=None)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """Validate the prompt against the context window, the vocabulary and the pool;
        return max_tokens. This is the only place prompts are checked: each error names the
        parameter to change (``InvalidSamplingParam.param``), which the server reports."""
        if not token_ids:
            raise InvalidSamplingParam("prompt", "the prompt is empty")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise PromptTooLong(
                "prompt", f"the prompt has {len(token_ids)} tokens but the model's context "
                f"length is {self.max_model_len}; shorten the prompt")
        vocab = self.arch.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise InvalidSamplingParam("prompt", f"prompt token ids must be in [0, {vocab})")
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.best_of > self.config.max_num_seqs:
            # best_of defaults to n: name the one the caller set.
            param = "n" if params.best_of == params.n else "best_of"
            raise InvalidSamplingParam(
                param, f"{param}={params.best_of} exceeds the {self.config.max_num_seqs} "
                "sequences the engine runs at once (max_num_seqs)")
        capacity = self.kv.num_blocks * self.kv.block_size
        needed = self._worst_case_blocks(len(token_ids), max_tokens, params.best_of)
        if needed * self.kv.block_size > capacity:
            raise PromptTooLong(
                "max_tokens",
                f"the request needs up to {needed * self.kv.block_size} tokens of KV cache "
                f"but the whole pool holds {capacity}; lower max_tokens (or n, best_of) or "
                "enlarge the cache")
        return max_tokens

    def _worst_case_blocks(self, num_prompt: int, max_tokens: int, num_streams: int) -> int:
        """Blocks of ``num_streams`` streams sharing the prompt and then fully diverging, each
        extra one with its own copy of the prompt's last partial block."""
        extra = self.kv.blocks_for(max_tokens) + 1
        return self.kv.blocks_for(num_prompt + max_tokens) + (num_streams - 1) * extra

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed(stream_seed(params.seed, index))
        return generator

    def abort_request(self, request_id: str) -> None:
        state = self._states.get(request_id)
        if state is None:
            return
        self._forget(state)
        for seq in state.seqs:
            self.scheduler.finish(seq.request, RequestStatus.FINISHED_ABORTED)
        if not self._states:
            self._in_flight = None  # it computes for aborted requests only

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        run_ahead = self.async_scheduling and not self._num_step_by_step
        if self._in_flight is not None and not run_ahead:
            return self._apply(self._take_in_flight())  # settle before a synchronous step
        out = self.scheduler.schedule(schedule_pending=run_ahead)
        if out.is_empty:
            # Nothing runs, but preempted streams' blocks must still reach the swap pool.
            self.runner.apply_block_ops(out.block_ops)
            return self._apply(self._take_in_flight()) if self._in_flight is not None else []
        now = time.time()
        for item in out.scheduled:
            metrics = self._states[self._parent_id(item.request)].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.num_cached_tokens = item.request.num_cached_tokens
        previous = self._in_flight
        result = self.runner.execute(out, self._sampling_metadata(out),
                                     previous.in_flight_tokens() if previous else None)
        self.scheduler.advance(out)
        self._prompt_tokens += sum(
            max(0, min(s.num_new_tokens, s.request.num_prompt_tokens - s.num_computed_tokens))
            for s in out.scheduled)
        if not run_ahead:
            return self._apply(result)
        # The device computes this step while the host applies the previous one.
        self._in_flight = result
        return self._apply(previous) if previous is not None else []

    def _take_in_flight(self) -> StepResult:
        result, self._in_flight = self._in_flight, None
        return result

    def _apply(self, result: StepResult) -> list[RequestOutput]:
        """A computed step's effects: prompt logprobs, sampled tokens, finished requests."""
        touched = self._apply_prompt_logprobs(result)
        touched |= self._apply_samples(result)
        outputs = self._collect_outputs(touched)
        if not self._states:
            # Everything the step in flight computes belongs to finished requests.
            self._in_flight = None
        return outputs

    def _parent_id(self, request: Request) -> str:
        return request.request_id.split("#", 1)[0]

    def _sampling_metadata(self, out: SchedulerOutput) -> SamplingMetadata | None:
        rows = [self._seqs[s.request.request_id] for s in out.scheduled if s.samples]
        if not rows:
            return None
        meta = SamplingMetadata.build(
            params=[r.request.params for r in rows],
            prompt_token_ids=[r.request.prompt_token_ids for r in rows],
            output_token_ids=[r.request.output_token_ids for r in rows],
            generators=[r.generator for r in rows],
            eos_token_ids=sorted(self.eos_token_ids),
            vocab_size=self.arch.vocab_size,
            device=self.runner.device,
        )
        # Beams read their candidates from the top-k logprobs.
        meta.max_num_logprobs = max(meta.max_num_logprobs, *(r.beam_candidates for r in rows))
        return meta

    def _apply_prompt_logprobs(self, result: StepResult) -> set[str]:
        touched = set()
        for seq_id, chunk in result.prompt_logprobs.items():
            seq = self._seqs[seq_id]
            if seq.index != 0:
                continue
            state = self._states[self._parent_id(seq.request)]
            r = chunk.result
            n = len(r.logprobs)
            # Row i scores the prompt token that follows position first_position + i.
            targets = seq.request.prompt_token_ids[chunk.first_position + 1:][:n]
            top_ids = r.top_ids.tolist() if r.top_ids is not None else [[]] * n
            top_vals = r.top_logprobs.tolist() if r.top_logprobs is not None else [[]] * n
            entries = [
                token_logprobs(tok, lp, rank, ids, vals, seq.detokenizer.decode_token)
                for tok, lp, rank, ids, vals in zip(
                    targets, r.logprobs.tolist(), r.ranks.tolist(), top_ids, top_vals,
                    strict=True)
            ]
            state.record_prompt_logprobs(chunk.first_position, entries)
            touched.add(state.request_id)
        return touched

    def _apply_samples(self, result: StepResult) -> set[str]:
        if result.sampler_output is None:
            return set()
        rows = _HostSamples.of(self.runner.fetch_samples(result))
        touched, beam_states = set(), {}
        now = time.time()
        for i, request in enumerate(result.sampled):
            seq_id = request.request_id
            seq = self._seqs.get(seq_id)
            # A stream that stopped (or was aborted, its id perhaps reused) since the step was
            # scheduled: its token is dropped.
            if seq is None or seq.request is not request or seq.finished:
                continue
            state = self._states[self._parent_id(seq.request)]
            if request.max_tokens == 0:  # only the prompt was asked for: no token is output
                self.scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                touched.add(state.request_id)
                continue
            if state.beam is not None:
                state.beam_offers[seq_id] = (rows.top_ids[i], rows.top_logprobs[i])
                beam_states[state.request_id] = state
                continue
            self._apply_sample(seq, rows, i)
            state.metrics.num_generated_tokens += 1
            _record_token_time(state, now)
            touched.add(state.request_id)
        for state in beam_states.values():
            if self._beam_step(state):
                _record_token_time(state, now)
                touched.add(state.request_id)
        return touched

    def _apply_sample(self, seq: SequenceState, rows: _HostSamples, i: int) -> None:
        seq.cumulative_logprob += rows.logprobs[i]
        if seq.logprobs is not None:
            k = seq.request.params.logprobs
            seq.logprobs.append(token_logprobs(
                rows.tokens[i], rows.logprobs[i], rows.ranks[i],
                rows.top_ids[i][:k] if k else [], rows.top_logprobs[i][:k] if k else [],
                seq.detokenizer.decode_token))
        self._append_token(seq, rows.tokens[i])

    # ---- beam search --------------------------------------------------------------------
    def _beam_step(self, state: RequestState) -> bool:
        """Once every running beam has offered its candidates, choose the next beams. Returns
        True when the search is done and the request has its outputs."""
        if any(s.request.request_id not in state.beam_offers for s in state.seqs):
            return False
        beams = [BeamCandidates(s.request.output_token_ids, s.cumulative_logprob,
                                *state.beam_offers.pop(s.request.request_id))
                 for s in state.seqs]
        continuations = state.beam.step(beams)
        self._generation_tokens += len(beams)
        state.metrics.num_generated_tokens += len(beams)
        if state.beam.done:
            self._finish_beam_search(state)
            return True
        self._rebuild_beams(state, continuations)
        return False

    def _rebuild_beams(self, state: RequestState,
                       continuations: list[BeamContinuation]) -> None:
        """Turn this step's beams into the next: a beam chosen once continues in place, one
        chosen again forks (sharing all its blocks), one not chosen is dropped (freeing its
        own)."""
        old = state.seqs
        chosen: list[SequenceState] = []
        for c in continuations:
            parent = old[c.parent]
            chosen.append(self._fork_beam(state, parent) if parent in chosen else parent)
        for seq in old:
            if seq not in chosen:
                self._drop_seq(seq, RequestStatus.FINISHED_ABORTED)
        for seq, c in zip(chosen, continuations):
            seq.request.append_output(c.token_id)
            seq.cumulative_logprob = c.cumulative_logprob
        state.seqs = chosen

    def _fork_beam(self, state: RequestState, parent: SequenceState) -> SequenceState:
        child_id = f"{state.request_id}#{next(self._fork_ids)}"
        request = self.scheduler.fork(parent.request, child_id)
        return self._add_seq(state, request, parent.index)

    def _drop_seq(self, seq: SequenceState, status: RequestStatus) -> None:
        self.scheduler.finish(seq.request, status)
        self._seqs.pop(seq.request.request_id, None)

    def _finish_beam_search(self, state: RequestState) -> None:
        for seq in state.seqs:
            self._drop_seq(seq, RequestStatus.FINISHED_STOPPED)
        state.seqs = []
        state.beam_offers.clear()
        params = state.params
        state.beam_outputs = [
            beam_completion(i, hypothesis, IncrementalDetokenizer(
                self.tokenizer, state.prompt_token_ids, params) if params.detokenize else None)
            for i, hypothesis in enumerate(state.beam.best(params.n))
        ]

    def _append_token(self, seq: SequenceState, token: int) -> None:
        request = seq.request
        request.append_output(token)
        self._generation_tokens += 1
        if request.params.detokenize:
            seq.detokenizer.append(token)
        status = stop_status(request, token, seq.detokenizer.stop_reason)
        if status is not None:
            self.scheduler.finish(request, status)

    def _collect_outputs(self, touched: set[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in touched:
            state = self._states[request_id]
            if state.finished:
                for seq in state.seqs:
                    if seq.detokenizer.stop_reason is None:
                        seq.detokenizer.flush()
                self._forget(state)
                state.metrics.finished_time = time.time()
            elif state.params.output_kind == "final_only":
                continue
            outputs.append(state.to_output())
        return outputs

    def _forget(self, state: RequestState) -> None:
        """Drop a finished or aborted request's bookkeeping (its streams stay in
        ``state.seqs``)."""
        for seq in state.seqs:
            self._seqs.pop(seq.request.request_id, None)
        del self._states[state.request_id]
        self._num_step_by_step -= not _can_run_ahead(state.params)

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
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_swapped=len(self.scheduler.swapped),
            blocks_shared=pool.num_shared,
        )


class _HostSamples(NamedTuple):
    """A step's sampler output as host lists: one transfer per tensor for the whole batch."""

    tokens: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None

    @classmethod
    def of(cls, sampled: SamplerOutput) -> _HostSamples:
        return cls(
            sampled.token_ids.tolist(), sampled.logprobs.tolist(), sampled.ranks.tolist(),
            sampled.top_ids.tolist() if sampled.top_ids is not None else None,
            sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None)


def _can_run_ahead(params: SamplingParams) -> bool:
    """Whether a request's next step may be scheduled before the host has seen its last token:
    not when the next logits read the outputs so far (penalties, min_tokens), when the host
    picks the tokens (beam search) or when prompt logprobs are read back as they are made."""
    return not (params.use_beam_search or params.min_tokens or params.prompt_logprobs is not None
                or params.repetition_penalty != 1.0 or params.presence_penalty
                or params.frequency_penalty)


def _record_token_time(state: RequestState, now: float) -> None:
    state.metrics.first_token_time = state.metrics.first_token_time or now
    state.metrics.last_token_time = now
