"""Start-up forwards that serve no request: the memory profile that sizes the KV pool, and with
bucketed shapes one forward per shape, so that a device that compiles per shape does so before
the first request. Both run dummy steps of throwaway sequences through the rank's runner."""

from __future__ import annotations

import time

import torch

from pagedserve.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedserve.core.sequence import Sequence
from pagedserve.logger import get_logger
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.input_batch import ModelInputs, build_inputs
from pagedserve.worker.kv_cache import KVCacheSpec
from pagedserve.worker.model_runner import ModelRunner

logger = get_logger(__name__)


@torch.inference_mode()
def warm_up(runner: ModelRunner) -> None:
    """With bucketed shapes, run each decode shape and one prompt step per token bucket once
    (``len(seqs) * len(widths) + len(tokens)`` forwards at most). Every block table is the pad
    block, so nothing else is written; the outputs are dropped, so its unwritten slots may be
    read."""
    if runner.buckets is None:
        return
    start = time.perf_counter()
    steps = [*_decode_steps(runner), *_prompt_steps(runner)]
    for out in steps:
        runner.run_model(_inputs(runner, out))
    runner.platform.synchronize()
    logger.info("warm-up: %d steps over bucketed shapes (at most %d) in %.1fs", len(steps),
                runner.buckets.num_shapes, time.perf_counter() - start)


@torch.inference_mode()
def profile_peak_memory(runner: ModelRunner, num_tokens: int, max_num_seqs: int,
                        block_size: int) -> int:
    """Peak device bytes of a forward over ``num_tokens`` prompt tokens plus sampling for
    ``max_num_seqs`` rows, with a throwaway KV pool just large enough. The tokens are split
    into prompts of at most ``max_model_len``, as a real step's would be, and the last one is
    a sequence of its own, as a decode beside prompt chunks is.

    A backend may attend a mixed step's one-row sequences apart (CUDA's decode kernel), so a
    step of prompts alone runs other kernels: a two-token prompt alone runs too, so both forms
    compile here instead of in the first steps that serve requests (on the H200, a second or
    more each)."""
    lengths = _split_prompt(runner, num_tokens - 1) + [1]
    tables, next_block = [], 0
    for n in [*lengths, 2]:
        blocks = -(-n // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    *tables, alone = tables
    platform = runner.platform
    platform.reset_peak_memory()
    runner.allocate_kv_cache(KVCacheSpec(next_block, block_size, runner.kv_dtype))
    out = SchedulerOutput([
        ScheduledSequence(Sequence([0] * n, SamplingParams(), max_tokens=1),
                          0, n, table, num_sample_positions=1)
        for n, table in zip(lengths, tables)])
    hidden = runner.run_model(_inputs(runner, out))
    # Without an LM head (--runner pooling) no step computes logits.
    logits = (None if runner.model.lm_head is None
              else runner.model.compute_logits(hidden[-1:].expand(max_num_seqs, -1)))
    if logits is not None:  # the driver alone samples (and gathers the logits)
        logits.float().softmax(-1)
    runner.run_model(_inputs(runner, SchedulerOutput([ScheduledSequence(
        Sequence([0] * 2, SamplingParams(), max_tokens=1), 0, 2, alone,
        num_sample_positions=1)])))
    platform.synchronize()
    peak = platform.peak_memory_bytes()
    runner.kv_cache = None
    return peak


def _decode_steps(runner: ModelRunner) -> list[SchedulerOutput]:
    steps = []
    for width in runner.buckets.widths:
        # A context that needs exactly ``width`` blocks, within max_model_len.
        context = min(width * runner.block_size, runner.max_model_len) - 1
        seq = Sequence([0] * (context + 1), SamplingParams(), max_tokens=1)
        item = ScheduledSequence(seq, context, 1, [runner.pad_block] * width,
                                 num_sample_positions=0)
        steps += [SchedulerOutput([item] * n) for n in runner.buckets.seqs]
    return steps


def _prompt_steps(runner: ModelRunner) -> list[SchedulerOutput]:
    steps = []
    for tokens in runner.buckets.tokens[1:]:
        # One token fewer than the bucket: the padded sequence takes the last one.
        lengths = _split_prompt(runner, tokens - 1)
        steps.append(SchedulerOutput([
            ScheduledSequence(Sequence([0] * n, SamplingParams(), max_tokens=1), 0, n,
                              [runner.pad_block] * -(-n // runner.block_size),
                              num_sample_positions=0)
            for n in lengths]))
    return steps


def _split_prompt(runner: ModelRunner, num_tokens: int) -> list[int]:
    """``num_tokens`` as prompts of at most ``max_model_len``, as a real step's are."""
    return [min(runner.max_model_len, num_tokens - start)
            for start in range(0, num_tokens, runner.max_model_len)]


def _inputs(runner: ModelRunner, out: SchedulerOutput) -> ModelInputs:
    return build_inputs(out, runner.block_size, runner.device, None, runner.buckets,
                        runner.pad_block)
