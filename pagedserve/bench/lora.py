"""``pagedserve bench lora``: multi-LoRA serving against the base model, in one call.

Random adapters (``bench.random_adapters``: rank ``--max-lora-rank`` on all seven projections,
PEFT folders in a temporary folder removed at the end) over the model of the flags (with
``--shape``, random weights of a real shape). Two engines, one after the other: the base
model's (no ``--enable-lora``), then one with ``--enable-lora`` and the flags' ``--max-loras``
and ``--max-cpu-loras``. Every request has fixed input and output lengths and ignores EOS, so
every row outputs the same tokens. Workloads (``--workloads``):

- ``adapters``: ``--num-prompts`` requests spread round-robin over each of
  ``--adapter-counts`` adapters; output tok/s over the base engine's on the same prompts, and
  over the LoRA engine's own base requests (a step without adapters runs the base model's
  forward; these take turns with the adapter rows).
- ``decode``: the batch-1 decode step with one adapter over the base engine's step.
- ``cycling``: the same requests over ``--cycle-adapters`` adapters, more than the slots:
  output tok/s and slot loads (adapters written into a device slot) per second.

Before each timed row a short warm-up run uses the row's adapters, so the adapters are read
from their folders (and, where they fit, in slots) before the clock starts; a timed row's slot
loads are those its own scheduling caused, from host memory when ``--max-cpu-loras`` holds
them. With ``--rounds N`` an engine's rows take turns N times and each reports its median
run; ``--side-by-side`` keeps both engines at once, so the base engine's runs take turns with
the adapter rows too (for a busy host, as a shared CPU machine is).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pagedserve.arg_types import positive
from pagedserve.bench.common import (
    WorkItem,
    print_table,
    random_workload,
    seconds_per_step,
    write_result,
)

WORKLOADS = ("adapters", "decode", "cycling")


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.set_defaults(max_loras=32, max_lora_rank=16, max_cpu_loras=128)
    parser.add_argument("--shape", default=None,
                        help="random weights of a real shape (dummy load format), e.g. "
                             "llama3-8b")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--num-prompts", type=positive(int), default=1000)
    parser.add_argument("--input-len", type=positive(int), default=128)
    parser.add_argument("--output-len", type=positive(int), default=128)
    parser.add_argument("--adapter-counts", type=positive(int), nargs="+", default=[1, 8, 32],
                        help="--workloads adapters: adapters the requests are spread over")
    parser.add_argument("--cycle-adapters", type=positive(int), default=128,
                        help="--workloads cycling: adapters, more than --max-loras")
    parser.add_argument("--decode-steps", type=positive(int), default=64,
                        help="--workloads decode: timed steps")
    parser.add_argument("--rounds", type=positive(int), default=1,
                        help="--workloads adapters: timed runs of each row, taking turns; the "
                             "median counts (for a busy host)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="build both engines at once, the base engine's runs taking turns "
                             "with the adapter rows (memory for two engines: CPU runs)")
    parser.add_argument("--threads", type=positive(int), default=None,
                        help="CPU threads (default: the platform's)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")


@dataclass
class BasePart:
    """What the base engine's turn leaves for the LoRA engine's and the report."""
    setup: dict
    work: list[WorkItem]
    adapters: list  # LoRARequest, written under the temporary folder
    rows: dict


def main(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="pagedserve-lora-") as tmp:
        if args.side_by_side:
            base, rows = _with_engine(args, lambda base_llm: _with_engine(
                args, lambda lora_llm: _side_by_side(base_llm, lora_llm, Path(tmp), args),
                enable_lora=True), enable_lora=False)
        else:
            base = _with_engine(args, lambda llm: _base_part(llm, Path(tmp), args),
                                enable_lora=False)
            rows = _with_engine(args, lambda llm: _lora_rows(llm, base, args), enable_lora=True)
    _report(base.setup, base.rows, rows, args)


def _side_by_side(base_llm, lora_llm, folder: Path, args: argparse.Namespace
                  ) -> tuple[BasePart, dict]:
    """Both engines at once: the base engine's throughput runs take turns with the adapter
    rows."""
    base = _base_part(base_llm, folder, args, throughput=False)
    runs = _rounds({"base": (base_llm, [None] * len(base.work)),
                    **_adapter_plan(lora_llm, base, args)}, base.work, args.rounds)
    base.rows["throughput"] = runs.pop("base")
    return base, _lora_rows(lora_llm, base, args, adapter_rows=runs)


def _with_engine(args: argparse.Namespace, run, **changes):
    """``run(llm)`` on the engine of the flags with ``changes`` to its config; the engine is
    shut down and its device memory given back afterwards, so the next one has the card."""
    from pagedserve.bench.throughput import engine_from_args

    llm = engine_from_args(args, **changes)
    platform = llm.engine.platform
    try:
        return run(llm)
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        platform.release_cached_memory()


def _base_part(llm, folder: Path, args: argparse.Namespace, throughput: bool = True
               ) -> BasePart:
    """The workload, the adapters (written with the base engine's device), the base rows
    (without the throughput run when not ``throughput``)."""
    from pagedserve.bench.random_adapters import adapter_numel, write_random_adapters

    engine = llm.engine
    work = random_workload(args.num_prompts, (args.input_len,) * 2, (args.output_len,) * 2,
                           engine.arch.vocab_size, set(engine.tokenizer.all_special_ids),
                           seed=args.seed)
    setup = {"model": engine.model_name, "device": engine.platform.name,
             "dtype": str(engine.dtype), "num_prompts": len(work), "input_len": args.input_len,
             "output_len": args.output_len, "rank": args.max_lora_rank,
             "max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras,
             "adapter_mb": adapter_numel(engine.arch, args.max_lora_rank)
             * engine.dtype.itemsize / 1e6}
    setup["load_average_at_start"] = os.getloadavg()
    start = time.perf_counter()
    adapters = write_random_adapters(folder, engine.arch, _num_adapters(args),
                                     args.max_lora_rank, engine.dtype,
                                     engine.platform.device(), args.seed)
    setup["adapters_written_s"] = time.perf_counter() - start
    return BasePart(setup, work, adapters, _base_rows(llm, work, args, throughput))


def _num_adapters(args: argparse.Namespace) -> int:
    """The most adapters a workload asked for uses."""
    wanted = {"adapters": max(args.adapter_counts), "decode": 1, "cycling": args.cycle_adapters}
    return max(wanted[w] for w in args.workloads)


def _base_rows(llm, work: list[WorkItem], args: argparse.Namespace, throughput: bool) -> dict:
    """The base engine: the throughput of the work, the batch-1 decode step."""
    rows = {}
    if throughput and {"adapters", "cycling"} & set(args.workloads):
        rows["throughput"] = _rounds({"base": (llm, [None] * len(work))}, work,
                                     args.rounds)["base"]
    if "decode" in args.workloads:
        rows["decode_ms"] = _decode_step_ms(llm, work[0].prompt_token_ids, args.decode_steps)
    return rows


def _adapter_plan(llm, base: BasePart, args: argparse.Namespace) -> dict:
    """The ``adapters`` workload's rows: each adapter count (0: base requests) and its
    requests' adapters."""
    return {n: (llm, _round_robin(base.adapters[:n], len(base.work)))
            for n in [0, *args.adapter_counts]}


def _lora_rows(llm, base: BasePart, args: argparse.Namespace, adapter_rows: dict | None = None
               ) -> dict:
    """The LoRA engine: a row per adapter count (unless ``adapter_rows`` has them), the decode
    steps, the cycling row."""
    rows: dict = {}
    work, adapters = base.work, base.adapters
    if "adapters" in args.workloads:
        rows["adapters"] = adapter_rows if adapter_rows is not None else _rounds(
            _adapter_plan(llm, base, args), work, args.rounds)
    if "decode" in args.workloads:
        prompt = work[0].prompt_token_ids
        rows["decode_ms"] = {"no_adapter": _decode_step_ms(llm, prompt, args.decode_steps),
                             "one_adapter": _decode_step_ms(llm, prompt, args.decode_steps,
                                                            adapters[0])}
    if "cycling" in args.workloads:
        loras = _round_robin(adapters[:args.cycle_adapters], len(work))
        rows["cycling"] = _timed_run(llm, work, loras)
    return rows


def _round_robin(adapters: list, num: int) -> list:
    """Request ``i``'s adapter: ``adapters[i % len]``; all None without adapters."""
    return [adapters[i % len(adapters)] if adapters else None for i in range(num)]


def _rounds(plan: dict, work: list[WorkItem], rounds: int) -> dict:
    """For each key of ``plan`` (an engine and each request's adapter), ``rounds`` timed runs
    of ``work``, the keys taking turns so a busy host slows each alike; each key's run of the
    median rate, with every round's rate."""
    runs: dict = {key: [] for key in plan}
    for _ in range(rounds):
        for key, (llm, loras) in plan.items():
            runs[key].append(_timed_run(llm, work, loras))
    medians = {}
    for key, results in runs.items():
        rates = [r["output_tok_s"] for r in results]
        medians[key] = {**sorted(results, key=lambda r: r["output_tok_s"])[len(results) // 2],
                        "output_tok_s_per_round": rates}
    return medians


def _timed_run(llm, work: list[WorkItem], loras: list) -> dict:
    """A warm-up of one request per distinct adapter, ``work``'s first prompt with a few
    output tokens (reads each adapter from its folder, and runs both the prefill's and the
    decode's kernels: a prompt is more rows than BGMV takes), then ``work`` timed, with the
    slot loads it caused."""
    from pagedserve.bench.throughput import run_engine

    distinct = list(dict.fromkeys(loras))
    warm = [WorkItem(work[0].prompt_token_ids, 4) for _ in distinct]
    run_engine(llm, warm, loras=distinct)
    loads, cpu_start = _slot_loads(llm), time.process_time()
    result = run_engine(llm, work, loras=loras)
    # This process's CPU seconds: on a shared CPU host, less moved by other jobs than wall time.
    result["output_tok_per_cpu_s"] = result["output_tokens"] / (time.process_time() - cpu_start)
    result["slot_loads"] = _slot_loads(llm) - loads
    result["slot_loads_per_s"] = result["slot_loads"] / result["seconds"]
    return result


def _slot_loads(llm) -> int:
    """Adapters written into a device slot so far (rank 0's slots; 0 without LoRA)."""
    slots = llm.engine.executor.runner.lora
    return slots.loads if slots is not None else 0


def _decode_step_ms(llm, prompt: list[int], steps: int, lora=None) -> float:
    """Mean milliseconds of a decode step of one sequence (after its prefill and three
    warm-up steps)."""
    from pagedserve.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    request_id = engine.add_request(prompt, params, lora_request=lora)
    for _ in range(4):  # the prefill, then decode steps at this shape
        engine.step()
    seconds = seconds_per_step(engine, steps)
    engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return seconds * 1e3


def _report(setup: dict, base: dict, rows: dict, args: argparse.Namespace) -> None:
    result = {**setup, "load_average_at_end": os.getloadavg(), "base": base, **rows}
    if "throughput" in base:
        base_rate = base["throughput"]["output_tok_s"]
        table = [{"adapters": "base engine", **base["throughput"], "vs_base": 1.0}]
        adapters = rows.get("adapters", {})
        for n, row in adapters.items():
            row["vs_base"] = row["output_tok_s"] / base_rate
            # Base requests on the LoRA engine run the base model's forward (no adapter in
            # the step) and took turns with these rows: the same-engine comparison.
            row["vs_no_adapter"] = row["output_tok_s"] / adapters[0]["output_tok_s"]
            table.append({"adapters": n or "none (LoRA engine)", **row})
        if "cycling" in rows:
            rows["cycling"]["vs_base"] = rows["cycling"]["output_tok_s"] / base_rate
            table.append({"adapters": f"{args.cycle_adapters} cycling", **rows["cycling"]})
        print_table(f"bench lora: {setup['num_prompts']} x {args.input_len}/{args.output_len}, "
                    f"rank {setup['rank']}, {args.max_loras} slots, device {setup['device']}",
                    table, ["adapters", "seconds", "output_tok_s", "vs_base", "vs_no_adapter",
                            "output_tok_per_cpu_s", "slot_loads", "slot_loads_per_s"])
    if "decode_ms" in base:
        decode = rows["decode_ms"]
        decode["one_adapter_vs_base"] = decode["one_adapter"] / base["decode_ms"]
        print_table("batch-1 decode step (ms)", [{"base engine": base["decode_ms"], **decode}],
                    ["base engine", "no_adapter", "one_adapter", "one_adapter_vs_base"])
    write_result(f"lora_{setup['device']}_{setup['model']}", result, args.out)
