"""Where the CPU's `bench throughput` workload spends its time (issue 31's profile): steps that
carry prompt tokens against decode-only steps, and in each the quantized matmuls by kernel
(``native_quant.kernel_for``: int8 activations, else the packed float32 GEMV up to
``GEMV_MAX_ROWS`` rows and dequantized tiles with torch.mm above), attention, and the whole
forward pass; the rest of a step is the engine around the model.

    .venv/bin/python scripts/cpu_throughput_split.py [--out JSON]

The default model, 64 requests (prompts 32-512 tokens, outputs 16-256, ignore_eos), greedy,
timed with wall clocks around the wrapped calls (the CPU runs them synchronously).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from pagedserve import LLM, SamplingParams
from pagedserve.bench.common import random_workload
from pagedserve.platforms.cpu import attention, native_quant

MATMUL_LABELS = {"int8": "matmul, int8 activations", "gemv": "matmul, packed GEMV kernel",
                 "dequant": "matmul, dequantized tiles + torch.mm"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    seconds: dict[str, float] = defaultdict(float)

    def timed(label_of, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            result = fn(*a, **k)
            seconds[label_of(*a)] += time.perf_counter() - start
            return result
        return wrapper

    native_quant.matmul = timed(
        lambda x, w, int8=True: MATMUL_LABELS[native_quant.kernel_for(x.shape[0], w, int8)],
        native_quant.matmul)
    cpu_attention = attention.CpuPagedAttention
    cpu_attention.forward = timed(lambda *a: "attention", cpu_attention.forward)
    engine = LLM(device="cpu").engine
    runner = engine.executor.runner
    runner.run_model = timed(lambda *a: "forward pass", runner.run_model)
    work = random_workload(64, (32, 512), (16, 256), engine.arch.vocab_size,
                           set(engine.tokenizer.all_special_ids), seed=0)
    for item in work:
        engine.add_request(item.prompt_token_ids, SamplingParams(
            max_tokens=item.output_len, temperature=0.0, ignore_eos=True, detokenize=False))
    split: dict[str, dict[str, float]] = {}
    steps: dict[str, int] = defaultdict(int)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        prompt_tokens = engine.stats().prompt_tokens
        step_start = time.perf_counter()
        engine.step()
        kind = ("steps with prompt tokens" if engine.stats().prompt_tokens > prompt_tokens
                else "decode-only steps")
        parts = split.setdefault(kind, defaultdict(float))
        parts["whole step"] += time.perf_counter() - step_start
        for label, value in seconds.items():
            parts[label] += value
        seconds.clear()
        steps[kind] += 1
    total = time.perf_counter() - start
    result = {"seconds": total, "output_tok_s": engine.stats().generation_tokens / total,
              "steps": dict(steps), "split_s": {k: dict(v) for k, v in split.items()}}
    print(f"{total:.1f} s, {result['output_tok_s']:.1f} output tok/s")
    for kind, parts in split.items():
        whole = parts["whole step"]
        print(f"{kind}: {steps[kind]} steps, {whole:.1f} s")
        for label in ("forward pass", *MATMUL_LABELS.values(), "attention"):
            print(f"  {label:38s} {parts[label]:6.2f} s  {parts[label] / whole:6.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
