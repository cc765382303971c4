"""``pagedserve bench structured``: what constrained decoding costs, on the engine.

Two runs of ``--num-requests`` concurrent chat requests in one invocation: all free, then half
constrained by a JSON schema and half free. Every request generates exactly
``--output-len`` tokens (free ones ignore EOS; the schema, an array of many small objects, is
longer than that), so both runs keep the same batch. TPOT is each request's
(last token - first token) / (tokens - 1), averaged over a half. The two runs alternate
``--repeats`` times and each is reported at its median repeat (by wall time). Since
end-to-end TPOT on a shared CPU varies by more than the targets, two steadier measures come
with it: the process's CPU time for each run (what the batch itself costs, whoever else
shares the cores), and the grammar's own work per step (building the bitmask of the
constrained half, masking its logits rows) timed alone against the all-free step time.
Grammar compilation is timed apart: the compiler's set-up (the tokenizer's vocabulary), a
cold compile and a cached one.
Targets: the free half within 5% of the all-free run, the constrained half within 15%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from pagedserve.arg_types import at_least, positive
from pagedserve.bench.common import print_table, write_result

# Long enough that no request finishes before --output-len tokens. No maxLength on the
# strings: xgrammar 0.2.8 takes about 10 ms per row to mask inside a length-bounded string,
# against tens of microseconds elsewhere (a cost of the library, not of the engine).
SCHEMA = {"type": "array", "minItems": 40, "maxItems": 40, "items": {
    "type": "object", "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}}


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--num-requests", type=at_least(2), default=32,
                        help="concurrent requests, half of them constrained in the mixed run "
                        "(it needs one of each)")
    parser.add_argument("--output-len", type=at_least(2), default=64,
                        help="tokens per request (TPOT needs two: it spans first to last)")
    parser.add_argument("--repeats", type=positive(int), default=2)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")


def _prompts(llm, num: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"List the members of team {i} as JSON."}],
        tokenize=False, add_generation_prompt=True) for i in range(num)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _tpot(output) -> float:
    m = output.metrics
    n = len(output.outputs[0].token_ids)
    return (m.last_token_time - m.first_token_time) / (n - 1)


def run(llm, prompts: list[list[int]], constrained: list[bool], output_len: int) -> dict:
    from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

    free = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    schema = SamplingParams(max_tokens=output_len, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, [schema if c else free for c in constrained],
                           use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    lengths = {len(o.outputs[0].token_ids) for o in outputs}
    if lengths != {output_len}:
        raise RuntimeError(f"requests generated {sorted(lengths)} tokens, not {output_len}")
    tpots = [_tpot(o) for o in outputs]
    halves = {kind: [t for t, c in zip(tpots, constrained) if c == kind] for kind in (0, 1)}
    return {"seconds": seconds, "tokens_per_s": len(prompts) * output_len / seconds,
            "cpu_seconds": cpu_seconds,
            **{f"tpot_{name}_ms": 1e3 * statistics.mean(halves[kind])
               for kind, name in ((0, "free"), (1, "constrained")) if halves[kind]}}


def _median(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def compile_times(llm) -> dict:
    from pagedserve.structured.spec import GrammarSpec

    engine = llm.engine
    start = time.perf_counter()
    pool = engine.grammars
    setup = time.perf_counter() - start
    spec = GrammarSpec("json", _schema_text(nonce=time.time_ns()))
    start = time.perf_counter()
    pool.get(spec).result()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    pool.get(spec).result()
    cached = time.perf_counter() - start
    return {"compiler_setup_ms": 1e3 * setup, "compile_cold_ms": 1e3 * cold,
            "compile_cached_ms": 1e3 * cached}


def mask_cost(llm, num_rows: int, reps: int = 20) -> float:
    """Milliseconds a step spends on the grammar of ``num_rows`` constrained rows in a batch
    of twice as many: their bitmask built on the host, then applied to the logits."""
    import json

    import torch

    from pagedserve.sample.sampler import apply_grammar_mask
    from pagedserve.structured.grammar_state import GrammarState, build_grammar_mask
    from pagedserve.structured.spec import GrammarSpec

    engine = llm.engine
    compiled = engine.grammars.get(GrammarSpec("json", json.dumps(SCHEMA))).result()
    prefix = llm.get_tokenizer().encode('[{"name": "Al', add_special_tokens=False)
    states = []
    for _ in range(num_rows):
        state = GrammarState(compiled)
        for token in prefix:
            state.accept(token)
        states += [None, state]
    vocab, device = engine.arch.vocab_size, engine.executor.runner.device
    logits = torch.randn(len(states), vocab, device=device)
    start = time.perf_counter()
    for _ in range(reps):
        apply_grammar_mask(logits, build_grammar_mask(states, vocab).to(device))
    engine.platform.synchronize()
    return 1e3 * (time.perf_counter() - start) / reps


def _schema_text(nonce: int) -> str:
    """SCHEMA with a description no earlier compile has seen (so it is compiled cold)."""
    import json

    return json.dumps({**SCHEMA, "description": f"run {nonce}"})


def main(args: argparse.Namespace) -> None:
    from pagedserve.engine_args import config_from_args
    from pagedserve.entrypoints.llm import LLM

    config = config_from_args(args)
    llm = LLM.from_config(config)
    n = args.num_requests
    prompts = _prompts(llm, n)
    compile_result = compile_times(llm)
    half = [i % 2 == 1 for i in range(n)]
    warm_up = min(n, 4)  # caches, the schema's grammar
    run(llm, prompts[:warm_up], half[:warm_up], 8)
    load_before = os.getloadavg()[0]
    repeats = [(run(llm, prompts, [False] * n, args.output_len),
                run(llm, prompts, half, args.output_len)) for _ in range(args.repeats)]
    all_free, mixed = (_median([r[i] for r in repeats]) for i in (0, 1))
    rows = [{"run": "all free", **all_free}, {"run": "half JSON schema", **mixed}]
    mask_ms = mask_cost(llm, n // 2)
    compile_result["grammar_ms_per_step"] = mask_ms
    compile_result["grammar_share_of_free_step"] = mask_ms / all_free["tpot_free_ms"]
    # CPU time of this process: what the batch itself costs, whatever else shares the cores.
    compile_result["cpu_time_mixed_vs_all_free"] = mixed["cpu_seconds"] / all_free["cpu_seconds"]
    free_ratio = mixed["tpot_free_ms"] / all_free["tpot_free_ms"]
    constrained_ratio = mixed["tpot_constrained_ms"] / all_free["tpot_free_ms"]
    result = {"model": config.model or "default", "device": config.device,
              "num_requests": n, "output_len": args.output_len,
              "load_average_1m": [load_before, os.getloadavg()[0]], "runs": rows,
              "repeats": [{"all_free": a, "mixed": m} for a, m in repeats],
              "free_half_vs_all_free": free_ratio,
              "constrained_half_vs_all_free": constrained_ratio, **compile_result}
    print_table(f"{n} concurrent requests x {args.output_len} tokens (TPOT: mean per "
                "request)", rows, ["run", "tpot_free_ms", "tpot_constrained_ms",
                                   "tokens_per_s", "seconds", "cpu_seconds"])
    print(f"free half / all free: {free_ratio:.3f} (target <= 1.05); constrained half / "
          f"all free: {constrained_ratio:.3f} (target <= 1.15)")
    print_table("grammar compilation, and the grammar's work per step (mask of the "
                "constrained half) against the all-free step", [compile_result],
                list(compile_result))
    write_result("structured", result, args.out)
