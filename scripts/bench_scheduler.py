"""The scheduler alone on the CPU: mean time of a ``schedule()`` call, no model, no engine.

4096 requests (32-token prompts, 64 output tokens each) run through ``max_num_seqs`` 256 with
prefix caching and partial prefills on; a pool of 1100 blocks of 16 makes them preempt each
other (recompute), 2048 does not. Best of five runs. ``--policy`` is passed only when given,
so the script also times a tree from before ``--scheduling-policy``::

    PYTHONPATH=. python scripts/bench_scheduler.py --num-blocks 1100 [--policy priority]
"""

from __future__ import annotations

import argparse
import time

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedserve.sampling_params import SamplingParams


def run(num_blocks: int, policy: str | None, num_requests: int) -> tuple[float, int, int]:
    """(mean seconds per schedule(), steps, preemptions) of one run."""
    extra = {} if policy is None else {"scheduling_policy": policy}
    cfg = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=2048,
                          enable_chunked_prefill=True, preemption_mode="recompute",
                          max_num_partial_prefills=4, **extra)
    sched = Scheduler(cfg, KVCacheManager(num_blocks, 16, enable_caching=True))
    params = SamplingParams()
    for i in range(num_requests):
        group = SequenceGroup(str(i), [Sequence([(i * 7 + j) % 500 + 3 for j in range(32)],
                                                params, max_tokens=64)])
        group.priority = i % 3 if policy == "priority" else 0
        sched.add_group(group)
    total, steps = 0.0, 0
    while sched.has_unfinished:
        start = time.perf_counter()
        out = sched.schedule()
        total += time.perf_counter() - start
        steps += 1
        sched.advance(out)
        for item in out.scheduled:
            if item.num_sample_positions:
                item.seq.append_output(7)
                if item.seq.num_output_tokens >= item.seq.max_tokens:
                    sched.finish(item.seq, SequenceStatus.FINISHED_LENGTH)
    return total / steps, steps, sched.num_preemptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-blocks", type=int, default=1100)
    parser.add_argument("--policy", default=None, help="fcfs or priority (default: not passed)")
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    seconds, steps, preemptions = min(run(args.num_blocks, args.policy, args.requests)
                                      for _ in range(args.repeats))
    print(f"policy={args.policy or 'default'} num_blocks={args.num_blocks} "
          f"schedule_us={seconds * 1e6:.1f} steps={steps} preemptions={preemptions}")


if __name__ == "__main__":
    main()
