"""``pagedserve bench decode``: time of one decode step at several batch sizes, against the
memory roofline (weight bytes + KV bytes read, over copy bandwidth measured in the same run).
The weight bytes leave out the input embedding table, of which a step reads only one row per
sequence.

With ``--cpu-offload-gb`` a step also moves the offloaded layers' bytes from host memory to
the device: the bus bound is those bytes over the host-to-device copy rate of the platform's
own host buffers (pinned on GPUs), measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

from pagedserve.arg_types import positive

REQUANTIZED = ("int8", "fp8")


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--shape", default=None, help="random weights of a real shape")
    parser.add_argument("--batch-sizes", type=positive(int), nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--context-len", type=positive(int), default=512)
    parser.add_argument("--steps", type=positive(int), default=32)
    parser.add_argument("--requantize", choices=REQUANTIZED, default=None,
                        help="requantize every linear layer of a --quantization none model: "
                             "int8: 8 bits in groups of 32, symmetric, as GGUF's Q8_0; fp8: "
                             "e4m3 with a scale per row, as --quantization fp8")
    parser.add_argument("--out", default=None)


def copy_bandwidth(platform, nbytes: int = 1 << 30) -> float:
    """Bytes moved (read + written) per second by a large device-to-device copy."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.float16, device=platform.device())
    dst = torch.empty_like(src)
    dst.copy_(src)
    platform.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    platform.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - start)


def host_to_device_bandwidth(platform, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a copy from a host buffer of the kind offloaded weights live in
    into device memory."""
    import torch

    src = platform.weight_stream(1).host_buffer(nbytes)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=platform.device())
    dst.copy_(src)
    platform.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    platform.synchronize()
    return nbytes * 10 / (time.perf_counter() - start)


class DecodeTimes(NamedTuple):
    median_s: float  # of the steps in which all the sequences decode one token each
    # From the end of the first such step to the end of the last: the wall time per step,
    # which counts a step's device time wherever the host happened to wait for it (async
    # scheduling). Not from its start: the first decode step waits for the prompts' step
    # still on the device (at batch 256 of 512 tokens, about a second of prefill).
    wall_s: float
    num_preemptions: int


def time_decode(engine, batch: int, context: int, steps: int) -> DecodeTimes:
    """Decode step times of ``batch`` sequences of ``context`` prompt tokens, once no prompt
    token is computed any more."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    for i in range(batch):
        engine.add_request([(i * 7 + j) % 1000 + 10 for j in range(context)], params)
    times, first, last, calls = [], None, None, 0
    preemptions = engine.stats().num_preemptions
    while engine.has_unfinished_requests():
        before = engine.stats()
        start = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        after = engine.stats()
        calls += first is not None
        if (after.prompt_tokens == before.prompt_tokens
                and after.generation_tokens - before.generation_tokens == batch):
            times.append(end - start)
            if first is None:
                first, calls = end, 0
            last, counted = end, calls
    median = statistics.median(times)
    return DecodeTimes(median, (last - first) / counted if counted else median,
                       engine.stats().num_preemptions - preemptions)


def requantize(model, kind: str) -> None:
    """Replace every dense linear weight by its ``kind`` (``REQUANTIZED``) quantization."""
    import torch

    from pagedserve.models.linear import Linear
    from pagedserve.quant.weights import Fp8Weight, GroupQuantWeight

    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        if kind == "fp8" and isinstance(layer, Linear) and not layer.quantize_at_load:
            continue  # the LM head, which --quantization fp8 leaves in float too
        if isinstance(layer, Linear) and isinstance(weight, torch.Tensor):
            dense = weight.detach()
            del layer.weight  # the tied LM head's is the embedding's, which stays
            layer.set_weight(Fp8Weight.quantize(dense) if kind == "fp8"
                             else GroupQuantWeight.quantize(dense, bits=8, group_size=32))


def main(args: argparse.Namespace) -> None:
    from pagedserve.bench.common import print_table, write_result
    from pagedserve.bench.throughput import engine_from_args

    if args.max_num_batched_tokens is None:
        # Every batch's prompts prefill in one step, so all its sequences then decode together.
        args.max_num_batched_tokens = max(args.batch_sizes) * args.context_len
    args.max_num_seqs = max(args.max_num_seqs, max(args.batch_sizes))
    if args.requantize and args.tensor_parallel_size > 1:
        from pagedserve.errors import ConfigError

        # Requantizing reaches rank 0's layers only.
        raise ConfigError("--requantize needs --tensor-parallel-size 1")
    llm = engine_from_args(args)
    engine = llm.engine
    if args.requantize:
        requantize(engine.executor.runner.model, args.requantize)
    bandwidth = copy_bandwidth(engine.platform)
    offload = engine.executor.runner.offload
    offloaded = offload.host_bytes if offload is not None else 0
    bus = host_to_device_bandwidth(engine.platform) if offloaded else None
    kv_per_token = engine.kv_bytes_per_block // engine.resolved.block_size
    rows = []
    for batch in args.batch_sizes:
        timed = time_decode(engine, batch, args.context_len, args.steps)
        step = timed.median_s
        kv_read = batch * (args.context_len + args.steps // 2) * kv_per_token
        weights = engine.executor.runner.weight_bytes_read_per_token_step(batch)
        roofline = (weights + kv_read) / bandwidth
        row = {"batch": batch, "step_ms": step * 1e3, "roofline_ms": roofline * 1e3,
               "weight_gib": weights / 2**30,
               "ratio_to_roofline": step / roofline, "tok_s": batch / step,
               "wall_step_ms": timed.wall_s * 1e3, "preemptions": timed.num_preemptions}
        if offloaded:
            row.update(bus_bound_ms=offloaded / bus * 1e3, bus_bound_tok_s=batch * bus / offloaded,
                       ratio_to_bus_bound=step * bus / offloaded)
        rows.append(row)
    # weight_gib: what a step reads (of a mixture of experts, the experts its batch touches).
    columns = ["batch", "step_ms", "wall_step_ms", "weight_gib", "roofline_ms",
               "ratio_to_roofline", "tok_s"]
    title = (f"decode step, context {args.context_len}, copy bandwidth {bandwidth / 1e9:.0f} "
             "GB/s")
    if offloaded:
        columns += ["bus_bound_ms", "bus_bound_tok_s", "ratio_to_bus_bound"]
        title += (f", {offloaded / 2**30:.2f} GiB offloaded over a {bus / 1e9:.1f} GB/s "
                  "host-to-device copy")
    print_table(title, rows, columns)
    label = "_".join(filter(None, (engine.platform.name, engine.model_name,
                                   args.quantization, str(engine.dtype).removeprefix("torch."),
                                   args.requantize,
                                   offloaded and f"offload{args.cpu_offload_gb:g}")))
    write_result(f"decode_{label}", {
        "model": engine.model_name, "quantization": args.quantization,
        "requantize": args.requantize, "dtype": str(engine.dtype),
        "kv_cache_dtype": engine.config.kv_cache_dtype, "copy_bandwidth_bytes_s": bandwidth,
        "cpu_offload_bytes": offloaded, "host_to_device_bytes_s": bus,
        "context_len": args.context_len,
        "rows": rows}, args.out)
