"""Host time of LoRA steps: CPU milliseconds per engine step of a compute-free LoRA engine
(``tiny-llama`` widths, 32 layers as Llama-3-8B has, so per-layer host work counts as often),
decoding with and without adapters, on the CPU. Where compute is negligible, what a row with
adapters adds over one without is host work. CPU time (``process_time``), not wall time: a
machine shared with other jobs slows the wall clock more.

    python scripts/lora_step_host.py            # batch 1 and 64, 0, 1 and 8 adapters
    python scripts/lora_step_host.py --cycling  # 1,024 requests over 8 adapters, 2 slots

Each row is the median of 5 runs of 40 steps (``--cycling``: 3 runs of 30). One CPU thread by
default (``--threads``): with more, a step's host time depends on how busy the other cores are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build(max_loras: int, max_num_seqs: int):
    from pagedserve.bench.dummy_model import write_dummy_folder
    from pagedserve.bench.random_adapters import write_random_adapters
    from pagedserve.entrypoints.llm import LLM

    tmp = Path(tempfile.mkdtemp())
    folder = write_dummy_folder("tiny-llama", tmp / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 32}))
    engine = LLM(model=str(folder), load_format="dummy", device="cpu", enable_lora=True,
                 max_loras=max_loras, max_cpu_loras=8, max_lora_rank=16,
                 max_num_seqs=max_num_seqs).engine
    return engine, write_random_adapters(tmp / "adapters", engine.arch, 8, 16, torch.float32,
                                         torch.device("cpu"))


def cpu_ms_per_step(engine, adapters, batch: int, num_adapters: int, steps: int) -> float:
    """After three steps (the prefill first), the mean CPU time of ``steps`` steps."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    for i in range(batch):
        engine.add_request([(i * 7 + j) % 500 + 3 for j in range(16)], params,
                           lora_request=adapters[i % num_adapters] if num_adapters else None)
    for _ in range(3):
        engine.step()
    start = time.process_time()
    for _ in range(steps):
        engine.step()
    seconds = (time.process_time() - start) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return seconds * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycling", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's CPU threads (0: its default, one per core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cycling:
        engine, adapters = build(max_loras=2, max_num_seqs=256)
        rows, runs, steps = [(1024, 8)], 3, 30
    else:
        engine, adapters = build(max_loras=8, max_num_seqs=64)
        rows, runs, steps = [(1, 0), (1, 1), (64, 0), (64, 1), (64, 8)], 5, 40
    for batch, num_adapters in rows:
        median = statistics.median(cpu_ms_per_step(engine, adapters, batch, num_adapters, steps)
                                   for _ in range(runs))
        print(f"batch {batch:4d}, {num_adapters} adapters: {median:.2f} CPU-ms/step",
              flush=True)


if __name__ == "__main__":
    main()
