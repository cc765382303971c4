"""``pagedserve bench quant-accuracy``: how far each weight format moves a model's greedy
output from its float32 run.

Per format: the share of prompts whose first ``--new-tokens`` greedy tokens equal the float32
run's, and the mean |Δ logprob| of the float32 run's tokens, each format scoring those same
tokens (teacher forced, through prompt logprobs) so that one early divergence does not decide
the rest.
"""

from __future__ import annotations

import argparse
import statistics

from pagedserve.arg_types import positive

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
    "Once upon a time, in a small village,", "The three primary colors are",
    "To make a cup of tea, first", "import numpy as np\n\nx =",
    "The largest planet in our solar system is", "Photosynthesis is the process by which",
    "My favourite book is", "SELECT name FROM users WHERE", "The French word for cat is",
    "In 1969, the first humans", "A haiku about autumn:\n", "The square root of 144 is",
    "Dear hiring manager,", "The quick brown fox", "Machine learning models are trained",
    "The best way to learn a language is", "<html>\n  <head>\n",
]
# name -> engine options, and what the linear layers are requantized to afterwards
DEQUANTIZED = {"quantization": "none", "dtype": "float32"}
FORMATS = {
    "float32": (DEQUANTIZED, None),
    "bfloat16": ({"quantization": "none", "dtype": "bfloat16"}, None),
    "GGUF blocks (int8 activations)": ({"quantization": "auto", "dtype": "float32"}, None),
    "GGUF blocks (float32 activations)": ({"quantization": "auto", "dtype": "float32",
                                           "int8_activations": False}, None),
    "GGUF blocks (bfloat16 activations)": ({"quantization": "auto", "dtype": "bfloat16",
                                            "int8_activations": False}, None),
    "int8, groups of 32": ({**DEQUANTIZED, "int8_activations": False}, "int8"),
    "int8, groups of 32, int8 activations": (DEQUANTIZED, "int8"),
    "fp8, a scale per row": (DEQUANTIZED, "fp8"),
}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--new-tokens", type=positive(int), default=16)
    parser.add_argument("--out", default=None)


def main(args: argparse.Namespace) -> None:
    from pagedserve.bench.common import print_table, write_result

    runs = {name: run_format(args.model, name, args.new_tokens)
            for name in ["float32", *[f for f in args.formats if f != "float32"]]}
    reference = runs["float32"]
    rows = [score(name, run, reference) for name, run in runs.items()]
    print_table(f"greedy agreement with float32, {len(PROMPTS)} prompts x {args.new_tokens} "
                "tokens", rows, ["format", "same_tokens", "mean_abs_dlogprob", "weight_mb"])
    write_result("quant_accuracy_cpu", {"model": args.model or "default",
                                        "new_tokens": args.new_tokens, "rows": rows}, args.out)


def run_format(model: str | None, name: str, new_tokens: int) -> dict:
    """Greedy tokens per prompt, and a scorer of given continuations under this format."""
    from pagedserve import LLM
    from pagedserve.bench.decode import requantize
    from pagedserve.sampling_params import SamplingParams

    options, requantized = FORMATS[name]
    llm = LLM(model=model, device="cpu", kv_cache_memory_bytes=256 << 20, **options)
    if requantized:
        requantize(llm.engine.executor.runner.model, requantized)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)

    def logprobs_of(continuations: list[list[int]]) -> list[list[float]]:
        score = SamplingParams(max_tokens=1, prompt_logprobs=0)
        seqs = [p + c for p, c in zip(prompts, continuations)]
        results = llm.generate(seqs, score, use_tqdm=False)
        return [[entry[tok].logprob for entry, tok in zip(r.prompt_logprobs[-len(c):], c)]
                for r, c in zip(results, continuations)]

    return {"tokens": [o.outputs[0].token_ids for o in outputs], "logprobs_of": logprobs_of,
            "weight_mb": llm.engine.executor.runner.weight_bytes() / 1e6}


def score(name: str, run: dict, reference: dict) -> dict:
    same = sum(a == b for a, b in zip(run["tokens"], reference["tokens"]))
    ours = run["logprobs_of"](reference["tokens"])
    theirs = reference["logprobs_of"](reference["tokens"])
    deltas = [abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    return {"format": name, "same_tokens": f"{same}/{len(PROMPTS)}",
            "mean_abs_dlogprob": statistics.fmean(deltas), "weight_mb": run["weight_mb"]}
