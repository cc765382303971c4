"""``pagedserve bench throughput``: our engine against HF transformers static batching.

The same prompts (varied input and output lengths, ignore_eos) run through both in one
process. HF gets each batch padded to its longest prompt and generates until the batch's
longest output, which is what static batching costs; only requested tokens are counted.
With ``--tensor-parallel-size N`` above 1 the engine also runs the same prompts on one rank,
so the run reports what splitting the model costs or gains.
"""

from __future__ import annotations

import argparse

from pagedserve.arg_types import MinMax, positive
from pagedserve.bench.common import Timer, print_table, random_workload, write_result


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=positive(int), default=64)
    parser.add_argument("--input-len", type=positive(int), action=MinMax, default=(32, 512))
    parser.add_argument("--output-len", type=positive(int), action=MinMax, default=(16, 256))
    parser.add_argument("--hf-batch-sizes", type=positive(int), nargs="+", default=[16, 32],
                        help="static batch sizes to try for HF; the best counts")
    parser.add_argument("--hf-max-prompts", type=positive(int), default=None,
                        help="time HF on the first N prompts only (its rate is what counts)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-tp1", action="store_true",
                        help="with --tensor-parallel-size above 1, leave out the same prompts "
                             "on one rank (for a model that does not fit one device)")
    parser.add_argument("--shape", default=None,
                        help="benchmark a real model shape with random weights "
                             "(dummy load format), e.g. llama3-8b, smollm2-135m")
    parser.add_argument("--profile", action="store_true",
                        help="print where the engine's host time goes (cProfile, top 30)")
    parser.add_argument("--breakdown", action="store_true",
                        help="time scheduling, queueing the forward pass, waiting for the "
                             "device and output handling separately")
    parser.add_argument("--device-timeline", action="store_true",
                        help="run the workload again (other prompts of the same lengths) under "
                             "torch.profiler and report the device's busy and idle time over "
                             "it, and its top kernels (bench/device_timeline.py; cuda)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")


class PhaseTimes:
    """Host seconds spent scheduling, queueing forward passes and waiting for the device in
    ``engine``'s steps, measured by wrapping those three calls; the rest of a step is output
    handling. Under async scheduling the waits are what the host could not hide. ``calls``:
    other (object, method name, key) triples to time instead."""

    def __init__(self, engine, calls=None) -> None:
        calls = calls or ((engine.scheduler, "schedule", "schedule_s"),
                          (engine.executor, "execute", "queue_forward_s"),
                          (engine.executor, "fetch", "wait_device_s"))
        self.totals = {key: 0.0 for _, _, key in calls}
        for owner, name, key in calls:
            setattr(owner, name, self._timed(getattr(owner, name), key))

    def _timed(self, fn, key: str):
        import time

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self.totals[key] += time.perf_counter() - start
            return result

        return timed

    def as_dict(self, total: float) -> dict:
        return {**self.totals, "other_host_s": total - sum(self.totals.values())}


def run_engine(llm, work, breakdown: bool = False, loras=None) -> dict:
    """``work`` through the engine, all added before the clock starts; ``loras``: the
    ``LoRARequest`` (or None) of each item."""
    from pagedserve.sampling_params import SamplingParams

    engine = llm.engine
    phases = PhaseTimes(engine) if breakdown else None
    for item, lora in zip(work, loras or [None] * len(work), strict=True):
        engine.add_request(item.prompt_token_ids, SamplingParams(
            max_tokens=item.output_len, temperature=0.0, ignore_eos=True, detokenize=False,
            output_kind="final_only"), lora_request=lora)
    allocated = filled = steps = 0
    with Timer() as t:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if steps % 8 == 0:  # a sample of steps keeps the bookkeeping off the clock
                stats = engine.stats()
                allocated += stats.kv_allocated_slots
                filled += stats.kv_filled_slots
    out_tokens = sum(w.output_len for w in work)
    return {"seconds": t.seconds, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / t.seconds, "steps": steps,
            "kv_waste": 1 - filled / allocated if allocated else 0.0,
            **(phases.as_dict(t.seconds) if phases else {})}


def run_hf(model, device, work, batch_size: int) -> dict:
    import torch

    pad = 0
    with Timer() as t, torch.inference_mode():
        for start in range(0, len(work), batch_size):
            batch = work[start:start + batch_size]
            width = max(len(w.prompt_token_ids) for w in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, w in enumerate(batch):  # left padding, as HF generation expects
                ids[i, width - len(w.prompt_token_ids):] = torch.tensor(w.prompt_token_ids)
                mask[i, width - len(w.prompt_token_ids):] = 1
            steps = max(w.output_len for w in batch)
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                           max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                           pad_token_id=pad)
    out_tokens = sum(w.output_len for w in work)
    return {"seconds": t.seconds, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / t.seconds, "batch_size": batch_size}


def run_hf_batches(args: argparse.Namespace, model_path, dtype, device, work) -> list[dict]:
    """HF transformers on (the first ``--hf-max-prompts`` of) the same work, one row per
    static batch size."""
    from pagedserve.bench.hf_model import load_hf_model
    from pagedserve.models.loader import resolve_model

    source = resolve_model(model_path, require_weights=not args.shape, revision=args.revision,
                           gguf_file=args.gguf_file)
    model = load_hf_model(source, dtype, device, bool(args.shape))
    hf_work = work[:args.hf_max_prompts] if args.hf_max_prompts else work
    return [{"system": f"hf-static-b{bs}", **run_hf(model, device, hf_work, bs)}
            for bs in args.hf_batch_sizes]


def bench_config(args: argparse.Namespace, **changes):
    """The ``EngineConfig`` the flags describe, with ``changes``; ``--shape`` swaps in random
    weights of a real shape (a checkpoint folder with no weights, written once per call)."""
    import dataclasses

    from pagedserve.engine_args import config_from_args

    config = dataclasses.replace(config_from_args(args), **changes)
    if args.shape:
        from pagedserve.bench.dummy_model import scratch_folder, write_dummy_folder

        folder = write_dummy_folder(args.shape, scratch_folder() / args.shape)
        config = dataclasses.replace(config, model=str(folder), load_format="dummy",
                                     served_model_name=args.shape)
    return config


def engine_from_args(args: argparse.Namespace, **changes):
    """The LLM the flags describe (``bench_config``)."""
    from pagedserve.entrypoints.llm import LLM

    return LLM.from_config(bench_config(args, **changes))


def _timeline(llm, args: argparse.Namespace, avoid: set[int]) -> dict:
    """The workload's lengths with other prompts (the prefix cache holds the timed run's),
    under the profiler: its wall seconds there and ``device_timeline``'s report, printed."""
    from pagedserve.bench.device_timeline import device_timeline

    if llm.engine.platform.name not in ("cuda", "rocm"):
        raise SystemExit(f"--device-timeline reads a GPU's kernels; the engine runs on "
                         f"{llm.engine.platform.name}")
    work = random_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                           llm.engine.arch.vocab_size, avoid, seed=args.seed + 1)
    profiled = {}
    report = device_timeline(lambda: profiled.update(run_engine(llm, work)))
    report["profiled_seconds"] = profiled["seconds"]
    print(f"\nunder the profiler: {report['profiled_seconds']:.3f} s, the device busy "
          f"{report['device_busy_s']:.3f} s, idle {report['device_idle_s']:.3f} s "
          f"({report['idle_in_long_gaps_s']:.3f} s in {report['long_gaps']} gaps of 1 ms or more)")
    for k in report["top_kernels"]:
        print(f"  {k['seconds']:8.3f} s {k['calls']:7d}  {k['name'][:90]}")
    return report


def main(args: argparse.Namespace) -> None:
    import gc

    llm = engine_from_args(args)
    engine = llm.engine
    avoid = set(engine.tokenizer.all_special_ids)
    work = random_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                           engine.arch.vocab_size, avoid, seed=args.seed)
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        ours = profiler.runcall(run_engine, llm, work, args.breakdown)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    else:
        ours = run_engine(llm, work, args.breakdown)
    if args.device_timeline:
        ours["timeline"] = _timeline(llm, args, avoid)
    setup = {
        "model": engine.model_name, "device": engine.platform.name,
        "dtype": str(engine.dtype), "num_prompts": len(work),
        "input_len": list(args.input_len), "output_len": list(args.output_len),
        "kv_cache_dtype": engine.config.kv_cache_dtype, "kv_blocks": engine.kv.num_blocks,
        "max_concurrent_tokens": engine.kv.num_blocks * engine.kv.block_size,
        "tensor_parallel_size": engine.config.tensor_parallel_size,
    }
    tp = setup["tensor_parallel_size"]
    one_rank = []
    if tp > 1 and not args.skip_tp1:
        engine.shutdown()
        del llm, engine
        gc.collect()
        llm = engine_from_args(args, tensor_parallel_size=1)
        engine = llm.engine
        one_rank = [{"system": "pagedserve-tp1", **run_engine(llm, work, args.breakdown)}]
    model_path, dtype, device = engine.config.model, engine.dtype, engine.executor.runner.device
    platform = engine.platform
    # The engine's KV pool fills the card: release it before HF loads its own copy.
    del llm, engine
    gc.collect()
    platform.release_cached_memory()
    hf_rows = [] if args.skip_hf else run_hf_batches(args, model_path, dtype, device, work)
    rows = [{"system": "pagedserve" if tp == 1 else f"pagedserve-tp{tp}", **ours}, *one_rank,
            *hf_rows]
    best = max((r["output_tok_s"] for r in hf_rows), default=None)
    ratio = ours["output_tok_s"] / best if best else None
    print_table(f"throughput: {len(work)} prompts, inputs {args.input_len}, outputs "
                f"{args.output_len}, device {setup['device']}, dtype {dtype}",
                rows, ["system", "seconds", "output_tokens", "output_tok_s", "kv_waste"])
    if args.breakdown:
        print_table("where the engine's time went (seconds)", [ours, *one_rank],
                    ["seconds", "schedule_s", "queue_forward_s", "wait_device_s",
                     "other_host_s", "steps"])
    if ratio is not None:
        print(f"\nratio pagedserve / best HF static batch = {ratio:.2f}x")
    write_result(f"throughput_{setup['device']}_{setup['model']}", {
        **setup, "pagedserve": ours, "hf": hf_rows, "ratio_vs_best_hf": ratio,
        **({"pagedserve_tp1": one_rank[0]} if one_rank else {}),
    }, args.out)
