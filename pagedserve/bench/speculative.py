"""``pagedserve bench speculative``: output tokens per second with speculative decoding
against without, in one process, the two engines taking turns round by round.

Three workloads: ``copy`` (batch 1, chat prompts that ask to repeat or lightly edit a given
text or code: where prompt lookup has something to find) and ``throughput`` (the 64 mixed
random requests of ``bench throughput``, all at once: where it has little to find and the
batch is large, so the drafts' policy should hold speculation back). Greedy, so both engines
output the same tokens; the table gives each round's rates, the ratio of the medians, and the
mean acceptance length (tokens a verify row outputs).

The third, ``verify`` (for random-weight shapes, ``--shape``), measures the cost side: the
step time of B decoding sequences each verifying k drafts against a plain step (k = 0), and
at batch 1 the speed-up at forced acceptance lengths (drafts from the target's own greedy
continuation, wrong after the first L - 1: synthetic, since random weights accept nothing on
their own), next to the model ``L * t_plain / t_verify``. With ``--draft-shape`` the
speculative config's model is a random draft of that shape, and each k is timed twice: with
the drafts given (the verify step alone) and drawn by the draft model inside the step (its
passes added: the difference is the drafter's time per step).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from pagedserve.arg_types import positive
from pagedserve.bench.common import print_table, random_workload, seconds_per_step, write_result

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'

_CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''
_TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a "
         "long discussion, the members agreed to increase funding for the library, to repair "
         "the roof of the community hall, and to hire two more staff for the summer program. "
         "The next meeting will take place on the first Monday of March.")
COPY_PROMPTS = [
    f"Repeat the following code exactly, without any comment:\n\n{_CODE}",
    f"Rename the function merge_sorted to merge_lists and repeat the code:\n\n{_CODE}",
    f"Repeat this paragraph word for word:\n\n{_TEXT}",
    f"Rewrite this paragraph, replacing Tuesday with Wednesday and changing nothing else:"
    f"\n\n{_TEXT}",
    "Copy this list exactly:\n1. apples\n2. bananas\n3. cherries\n4. dates\n5. elderberries\n"
    "6. figs\n7. grapes\n8. honeydew\n9. kiwis\n10. lemons",
    f"Add a docstring example to this function and repeat the rest unchanged:\n\n{_CODE}",
]


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.set_defaults(speculative_config=DEFAULT_SPEC)
    parser.add_argument("--workload", choices=("copy", "throughput", "verify"), default="copy")
    parser.add_argument("--shape", default=None,
                        help="random weights of a real shape (dummy load format), e.g. "
                             "llama3-8b; with --workload verify")
    parser.add_argument("--draft-shape", default=None,
                        help="--workload verify: a draft model of random weights of this shape "
                             "(e.g. llama3-1b) as the speculative config's model; the table "
                             "then also times steps whose drafts it draws")
    parser.add_argument("--eagle3", action="store_true",
                        help="--workload verify: a random EAGLE-3 head of the public layout for "
                             "--shape as the speculative config's model; the table then also "
                             "times steps whose drafts it draws, and the forced-acceptance "
                             "curve pays for its passes")
    parser.add_argument("--batch-sizes", type=positive(int), nargs="+", default=[1, 32, 256],
                        help="--workload verify")
    parser.add_argument("--draft-lens", type=positive(int), nargs="+", default=[1, 2, 4, 8],
                        help="--workload verify: drafts per sequence per step")
    parser.add_argument("--steps", type=positive(int), default=20,
                        help="--workload verify: timed steps")
    parser.add_argument("--rounds", type=positive(int), default=3)
    parser.add_argument("--max-tokens", type=positive(int), default=160,
                        help="per copy prompt (the throughput workload draws its own)")
    parser.add_argument("--threads", type=positive(int), default=None,
                        help="CPU threads (default: the platform's)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")


def _copy_round(llm, max_tokens: int) -> tuple[int, float]:
    """Each prompt alone (batch 1): output tokens and seconds."""
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    tokens, start = 0, time.perf_counter()
    for prompt in COPY_PROMPTS:
        out = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)
        tokens += len(out[0].outputs[0].token_ids)
    return tokens, time.perf_counter() - start


def _throughput_round(llm, max_tokens: int) -> tuple[int, float]:
    """``bench throughput``'s 64 requests at once (``max_tokens``: unused, they draw their
    own)."""
    from pagedserve import SamplingParams

    engine = llm.engine
    work = random_workload(64, (32, 512), (16, 256), engine.arch.vocab_size,
                           set(engine.eos_token_ids), seed=0)
    params = [SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)
              for w in work]
    start = time.perf_counter()
    outputs = llm.generate([w.prompt_token_ids for w in work], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs), time.perf_counter() - start


def main(args: argparse.Namespace) -> None:
    import torch

    from pagedserve import LLM
    from pagedserve.engine_args import config_from_args

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.workload == "verify":
        return _verify_main(args)
    spec_config = config_from_args(args)
    plain_config = dataclasses.replace(spec_config, speculative_config=None)
    engines = {"plain": LLM.from_config(plain_config), "speculative": LLM.from_config(spec_config)}
    run = _copy_round if args.workload == "copy" else _throughput_round
    rates: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[int]] = {name: [] for name in engines}
    for llm in engines.values():
        run(llm, args.max_tokens)  # warm-up: first-call costs, the drafts' step-time model
    counters = engines["speculative"].engine.speculation.counters
    start_counts = (counters.num_drafts, counters.num_accepted_tokens)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            n, seconds = run(llm, args.max_tokens)
            rates[name].append(n / seconds)
            tokens[name].append(n)
    num_drafts = counters.num_drafts - start_counts[0]
    accepted = counters.num_accepted_tokens - start_counts[1]
    ratio = statistics.median(rates["speculative"]) / statistics.median(rates["plain"])
    rows = [{"engine": name, "tok/s per round": " ".join(f"{r:.1f}" for r in rates[name]),
             "median tok/s": statistics.median(rates[name]), "tokens": tokens[name][0]}
            for name in engines]
    print_table(f"bench speculative ({args.workload}): speculative / plain = {ratio:.2f}x; "
                f"mean acceptance length {1 + accepted / num_drafts if num_drafts else 0:.2f} "
                f"over {num_drafts} verify rows", rows,
                ["engine", "tok/s per round", "median tok/s", "tokens"])
    write_result(f"speculative_{args.workload}", {
        "workload": args.workload, "speculative_config": dataclasses.asdict(
            spec_config.speculative_config),
        "rounds": args.rounds, "tok_per_s": rates, "output_tokens": tokens,
        "ratio_of_medians": ratio, "verify_rows": num_drafts, "accepted_tokens": accepted,
        "mean_acceptance_length": 1 + accepted / num_drafts if num_drafts else None,
        "accepted_per_position": counters.accepted_per_position,
        "same_tokens": tokens["plain"] == tokens["speculative"],
    }, args.out)


class _FreeDrafts:
    """A step-time model under which every draft pays: the policy verifies all it is given."""

    def record(self, num_tokens: int, verifies: bool, seconds: float) -> None:
        pass

    def coefficients(self) -> tuple[float, float, float]:
        return 1.0, 0.0, 0.0


class _SureAcceptance:
    """Every sequence's acceptance rate is 1: with ``_FreeDrafts`` the policy keeps all k
    drafts. (Measured rates near 0, as random weights give, would make the gains of the last
    drafts underflow next to the step's output, and the policy keep fewer.)"""

    def rate(self, seq) -> float:
        return 1.0

    def record(self, seq, num_proposed: int, num_accepted: int) -> None:
        pass

    def forget(self, seq) -> None:
        pass


class _ForcedDrafts:
    """``k`` drafts per row: the row's true continuation (``continuation``, from where the row
    is) for the first ``num_right``, then wrong tokens; without a continuation, all wrong."""

    def __init__(self, k: int, prompt_len: int = 0, continuation: list[int] | None = None,
                 num_right: int = 0) -> None:
        self.k, self.prompt_len = k, prompt_len
        self.continuation, self.num_right = continuation or [], num_right

    def propose(self, batch):
        import numpy as np

        drafts = []
        for tokens, room in zip(batch.token_ids, batch.num_tokens, strict=True):
            k = min(self.k, room)
            done = len(tokens) - self.prompt_len
            right = self.continuation[done:done + min(self.num_right, k)]
            # A token the target is unlikely to pick: the last one's neighbour.
            wrong = [(int(tokens[-1]) + 1 + j) % 1000 + 1 for j in range(k - len(right))]
            drafts.append(np.asarray(right + wrong, dtype=np.int64))
        return drafts


class _DraftSlots:
    """``k`` drafts per row, drawn by the draft model inside the step."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, batch):
        from pagedserve.spec_decode.proposer import DraftModelSlots

        return DraftModelSlots().propose(batch._replace(
            num_tokens=[min(self.k, room) for room in batch.num_tokens]))


def _step_time(llm, batch_size: int, k: int, steps: int, prompt: list[int],
               drafted: bool = False) -> float:
    """Mean seconds of a step of ``batch_size`` decoding sequences verifying ``k`` drafts
    (drawn by the draft model in the step when ``drafted``, else given)."""
    from pagedserve import SamplingParams

    engine = llm.engine
    if engine.speculation is not None:  # else an engine without speculation (k = 0)
        engine.speculation.proposer = _DraftSlots(k) if drafted else _ForcedDrafts(k)
    params = SamplingParams(max_tokens=steps * (k + 1) + 64, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for _ in range(batch_size)]
    while any(s.num_computed_tokens < s.num_tokens - 1 for g in engine.scheduler.running
              for s in g.seqs) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # warm-up at this shape
        engine.step()
    seconds = seconds_per_step(engine, steps)
    for request_id in ids:
        engine.abort_request(request_id)
    return seconds


class _ForcedAcceptance:
    """The rejection sampler of a batch-1 verify step, with the row's first ``length - 1``
    drafts accepted whatever the target says and the target's greedy token after them:
    synthetic acceptance, for drafts (a random EAGLE-3 head's) that are never right on their
    own and whose drafting passes must still run and be paid for. The output is then not the
    target's."""

    def __init__(self, length: int) -> None:
        from pagedserve.worker import model_runner

        self.length, self.module = length, model_runner
        self.original = model_runner.rejection_sample
        model_runner.rejection_sample = self

    def __call__(self, logits, meta, drafts, draft_probs=None, draws=None):
        import torch

        out = self.original(logits, meta, drafts, draft_probs, draws)
        if drafts.shape[0] != 1:
            raise RuntimeError("forced acceptance is a batch-1 measurement")
        n = min(self.length, logits.shape[0])
        tokens = out.sampled.token_ids.clone()
        tokens[0, :n - 1] = drafts[0, :n - 1]
        tokens[0, n - 1] = logits[n - 1].argmax()
        tokens[0, n:] = -1
        return out._replace(sampled=out.sampled._replace(token_ids=tokens),
                            num_emitted=torch.full_like(out.num_emitted, n))

    def restore(self) -> None:
        self.module.rejection_sample = self.original


def _generate(llm, prompt: list[int], new_tokens: int, proposer=None) -> tuple[list[int], float]:
    """Batch 1, greedy: the tokens and the seconds (with ``proposer``'s drafts)."""
    from pagedserve import SamplingParams

    if proposer is not None:
        llm.engine.speculation.proposer = proposer
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    return out, time.perf_counter() - start


def _forced_acceptance(llm, prompt: list[int], k: int, lengths: list[int],
                       new_tokens: int, plain_s: float | None = None) -> list[dict]:
    """Batch 1: tok/s with drafts right for the first L - 1, against plain decoding (this
    engine's without drafts, or ``plain_s``, an engine's without speculation). With
    ``plain_s`` the drafts are the EAGLE-3 head's, accepted by force (``_ForcedAcceptance``;
    the tokens then differ from plain decoding's, and ``same_tokens`` is None)."""
    def run(proposer) -> tuple[list[int], float]:
        return _generate(llm, prompt, new_tokens, proposer)

    on_device = plain_s is not None
    run(_ForcedDrafts(0))  # warm-up
    reference, own_plain_s = run(_ForcedDrafts(0))
    plain_s = plain_s or own_plain_s
    rows = []
    for length in lengths:
        counters = llm.engine.speculation.counters
        before = (counters.num_drafts, counters.num_accepted_tokens)
        forced = _ForcedDrafts(k, len(prompt), reference, length - 1)
        if on_device:
            patch = _ForcedAcceptance(length)
            try:
                tokens, seconds = run(_DraftSlots(k))
            finally:
                patch.restore()
        else:
            tokens, seconds = run(forced)
        rows_verified = counters.num_drafts - before[0]
        measured = 1 + (counters.num_accepted_tokens - before[1]) / max(rows_verified, 1)
        rows.append({"forced_L": length, "measured_L": measured,
                     "speedup": plain_s / seconds,
                     "same_tokens": None if on_device else tokens == reference})
    return rows


def _verify_main(args: argparse.Namespace) -> None:
    import gc
    import json
    import random

    from pagedserve.bench.dummy_model import (
        scratch_folder,
        write_dummy_eagle3_folder,
        write_dummy_folder,
    )
    from pagedserve.bench.throughput import engine_from_args

    drafted = args.draft_shape is not None or args.eagle3
    if args.draft_shape is not None:
        spec = json.loads(args.speculative_config)
        spec["model"] = str(write_dummy_folder(args.draft_shape, scratch_folder()))
        args.speculative_config = json.dumps({**spec, "method": "draft_model"})
    elif args.eagle3:
        spec = json.loads(args.speculative_config)
        spec["model"] = str(write_dummy_eagle3_folder(args.shape, scratch_folder()))
        args.speculative_config = json.dumps({**spec, "method": "eagle3"})
    rng = random.Random(0)
    base_ms, base_s = {}, None
    if args.eagle3:
        # The baseline is an engine without the head: an EAGLE engine runs the head's extend
        # pass on every step, drafting or not.
        base = engine_from_args(args, speculative_config=None)
        prompt = [rng.randrange(100, base.engine.arch.vocab_size - 100) for _ in range(128)]
        base_ms = {b: _step_time(base, b, 0, args.steps, prompt) for b in args.batch_sizes}
        _generate(base, prompt, 96)  # warm-up
        base_s = _generate(base, prompt, 96)[1]
        platform = base.engine.platform
        base.shutdown()
        del base
        gc.collect()  # what the engine held goes back to the device before the next starts
        platform.release_cached_memory()
    llm = engine_from_args(args)
    if llm.engine.speculation is None:
        raise SystemExit("--workload verify needs --speculative-config")
    llm.engine.speculation.step_times = _FreeDrafts()
    llm.engine.speculation.acceptance = _SureAcceptance()
    if not args.eagle3:
        prompt = [rng.randrange(100, llm.engine.arch.vocab_size - 100) for _ in range(128)]
    step_rows = []
    for batch_size in args.batch_sizes:
        own = _step_time(llm, batch_size, 0, args.steps, prompt)
        plain = base_ms.get(batch_size, own)
        row = {"batch": batch_size, "plain ms": plain * 1e3}
        if args.eagle3:  # this engine's steps without drafts: the head's extend pass added
            row["no drafts x"] = own / plain
        for k in args.draft_lens:
            row[f"k={k} x"] = _step_time(llm, batch_size, k, args.steps, prompt) / plain
        if drafted:  # the same steps with the draft model's or the head's passes
            for k in args.draft_lens:
                row[f"k={k} drafted x"] = _step_time(llm, batch_size, k, args.steps, prompt,
                                                     True) / plain
        step_rows.append(row)
        print(row, flush=True)
    k = max(args.draft_lens)
    curve = _forced_acceptance(llm, prompt, k, [1, 2, 3, 4, min(k + 1, 5)], 96, base_s)
    t_plain = step_rows[0]["plain ms"] if step_rows[0]["batch"] == 1 else None
    verified = f"k={k} drafted x" if args.eagle3 else f"k={k} x"
    for point in curve:
        verify_x = step_rows[0].get(verified) if t_plain is not None else None
        point["model"] = point["measured_L"] / verify_x if verify_x else None
    print_table(f"verify step time / plain step time ({args.shape or args.model})", step_rows,
                list(step_rows[0]))
    print_table(f"batch 1, k={k}, forced acceptance (synthetic): speed-up over plain decoding; "
                f"model = L * t_plain / t({verified[:-2]})", curve,
                ["forced_L", "measured_L", "speedup", "model", "same_tokens"])
    write_result(f"speculative_verify_{args.shape or 'model'}{'_eagle3' * args.eagle3}", {
        "shape": args.shape, "draft_shape": args.draft_shape, "eagle3": args.eagle3,
        "steps": args.steps,
        "step_times": step_rows, "forced_acceptance": curve, "k_for_curve": k}, args.out)

