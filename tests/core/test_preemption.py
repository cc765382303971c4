"""Groups of streams under memory pressure: forks, swap and recompute preemption, no thrashing.

The simulation runs the scheduler against ``SimulatedCache``: each step applies the block ops
as the runner does, writes every chunk and checks that each stream sees exactly its own tokens.
"""

import random
import zlib
from dataclasses import dataclass

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedserve.sampling_params import SamplingParams
from tests.kv_checks import SimulatedCache, assert_pools_full, check_pools

BLOCK = 4


def _scheduler(num_blocks=16, host_blocks=32, budget=16, mode="auto", max_seqs=8):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=True, num_host_blocks=host_blocks)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          max_model_len=256, enable_chunked_prefill=True,
                          preemption_mode=mode, watermark=0.0)
    return Scheduler(cfg, kv)


@dataclass(eq=False)
class _Named(Sequence):
    """A sequence with a name, so that simulated samples differ between sequences but not
    between runs."""

    name: str = ""


def _req(name, prompt, max_tokens=8):
    return _Named(list(prompt), SamplingParams(), max_tokens=max_tokens, name=name)


def _token(seq: _Named) -> int:
    """A deterministic "sample" that differs between streams."""
    return zlib.crc32(f"{seq.name}:{seq.num_tokens}".encode()) % 40 + 1


class _Sim:
    """Drives the scheduler like the engine: parallel streams append on their own, beam-like
    groups advance together once every beam has sampled (first beam forks, last is dropped)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.cache = SimulatedCache(sched.kv)
        self.beam_groups: set[int] = set()
        self.offers: set[Sequence] = set()
        self.samples: dict[int, int] = {}  # id(group) -> tokens sampled so far
        self.preempted_at: dict[int, int] = {}
        self.thrashes = 0
        self.forks = 0

    def add(self, group: SequenceGroup, beam: bool = False) -> None:
        if beam:
            self.beam_groups.add(id(group))
        self.samples[id(group)] = 0
        self.sched.add_group(group)

    def step(self):
        out = self.sched.schedule()
        self.cache.apply(out.block_ops)
        self.cache.run_step(out.scheduled)
        self.sched.advance(out)
        self._note_preemptions(out.preempted)
        for item in out.scheduled:
            if item.num_sample_positions:
                self._sample(item.seq)
        check_pools(self.sched.kv)
        return out

    def _note_preemptions(self, preempted: list[Sequence]) -> None:
        for group in {id(r.group): r.group for r in preempted}.values():
            progress = self.samples[id(group)]
            if self.preempted_at.get(id(group)) == progress:
                self.thrashes += 1
            self.preempted_at[id(group)] = progress

    def _sample(self, request: Sequence) -> None:
        group = request.group
        self.samples[id(group)] += 1
        if id(group) not in self.beam_groups:
            request.append_output(_token(request))
            if request.num_output_tokens >= request.max_tokens:
                self.sched.finish(request, SequenceStatus.FINISHED_LENGTH)
            return
        self.offers.add(request)
        if all(s in self.offers for s in group.seqs):
            self._beam_step(group)

    def _beam_step(self, group: SequenceGroup) -> None:
        beams = list(group.seqs)
        self.offers -= set(beams)
        if beams[0].num_output_tokens + 1 >= beams[0].max_tokens:
            for beam in beams:
                self.sched.finish(beam, SequenceStatus.FINISHED_STOPPED)
            return
        if len(beams) > 1:
            self.sched.finish(beams[-1], SequenceStatus.FINISHED_ABORTED)
            self.forks += 1
            beams[-1] = self.sched.fork(beams[0])
            beams[-1].name = f"{beams[0].name}.{self.forks}"
        for beam in beams:
            beam.append_output(_token(beam))

    def run(self, max_steps=2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished:
                return
            self.step()
        raise AssertionError("the workload did not finish")


def _random_workload(sim: _Sim, rng: random.Random, num: int) -> list[Sequence]:
    everyone = []
    for i in range(num):
        prompt = [rng.randrange(1, 6) for _ in range(rng.randint(1, 12))]
        kind, width = rng.choice(["single", "parallel", "beam"]), rng.randint(2, 3)
        root = _req(f"g{i}", prompt, max_tokens=rng.randint(3, 12))
        if kind == "single":
            sim.add(SequenceGroup(root.name, [root]))
        elif kind == "parallel":
            forks = [_req(f"g{i}#{k}", prompt, root.max_tokens) for k in range(1, width)]
            sim.add(SequenceGroup(root.name, [root], width=width, pending_forks=forks))
            everyone += forks
        else:
            sim.add(SequenceGroup(root.name, [root], width=width), beam=True)
        everyone.append(root)
    return everyone


@pytest.mark.parametrize("mode", ["auto", "swap", "recompute"])
@pytest.mark.parametrize("seed", range(4))
def test_random_groups_under_pressure_keep_contents_and_finish(mode, seed):
    # 14 blocks: the largest group (3 streams, 12 + 12 tokens) just fits alone.
    sched = _scheduler(num_blocks=14, mode=mode, max_seqs=12)
    sim = _Sim(sched)
    requests = _random_workload(sim, random.Random(seed), num=16)
    sim.run()
    assert all(r.status.finished for r in requests)
    assert sched.num_preemptions > 0
    assert sim.thrashes == 0
    assert_pools_full(sched.kv)


def test_parallel_streams_fork_after_all_but_the_last_prompt_token():
    sched = _scheduler()
    sim = _Sim(sched)
    root = _req("a", range(1, 11))  # 10 tokens: 2 full blocks and a half-full one
    forks = [_req(f"a#{k}", range(1, 11)) for k in (1, 2, 3)]
    sim.add(SequenceGroup(root.name, [root], width=4, pending_forks=forks))
    out = sim.step()
    assert [(s.seq.name, s.num_new_tokens) for s in out.scheduled] == [("a", 9)]
    out = sim.step()
    # Every stream computes the last prompt token itself, so each samples from its own row.
    assert [(s.seq.name, s.num_new_tokens, s.num_sample_positions) for s in out.scheduled] == [
        (r.name, 1, True) for r in [root, *forks]]
    kv = sched.kv
    assert len({kv.block_table(r)[0] for r in [root, *forks]}) == 1
    # Full blocks stay shared; the partial last block was copied by all but its last writer.
    assert len(out.block_ops.copies) == 3
    assert kv.pool.num_used == 2 + 4


def test_multi_stream_groups_swap_and_single_streams_recompute_in_auto_mode():
    sched = _scheduler(num_blocks=10, budget=64)
    sim = _Sim(sched)
    old = _req("old", range(1, 13), max_tokens=20)
    sim.add(SequenceGroup(old.name, [old]))
    sim.step()
    pair = _req("pair", range(1, 9), max_tokens=20)
    sim.add(SequenceGroup(pair.name, [pair], width=2,
                          pending_forks=[_req("pair#1", range(1, 9), 20)]))
    single = _req("single", range(20, 28), max_tokens=20)
    sim.add(SequenceGroup(single.name, [single]))
    swapped = recomputed = False
    for _ in range(60):
        out = sim.step()
        if any(r.group is pair.group for r in out.preempted):
            swapped |= pair.status is SequenceStatus.SWAPPED and bool(out.block_ops.swap_out)
        recomputed |= single in out.preempted
        if single in out.preempted:
            assert single.num_computed_tokens == 0 and single.group in sched.waiting
    assert swapped and recomputed


def test_swapped_group_comes_back_before_new_requests():
    sched = _scheduler(num_blocks=8, budget=64, mode="swap")
    sim = _Sim(sched)
    a, b = _req("a", range(1, 9), max_tokens=12), _req("b", range(1, 9), max_tokens=12)
    sim.add(SequenceGroup(a.name, [a]))
    sim.add(SequenceGroup(b.name, [b]))
    while b.group not in sched.swapped:
        sim.step()
    newcomer = _req("c", range(30, 34), max_tokens=2)
    sim.add(SequenceGroup(newcomer.name, [newcomer]))
    while newcomer.status is SequenceStatus.WAITING:
        sim.step()
    assert b.status is not SequenceStatus.SWAPPED
    sim.run()
    assert_pools_full(sched.kv)


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    sched = _scheduler(num_blocks=8, host_blocks=1, budget=64, mode="swap")
    sim = _Sim(sched)
    a, b = _req("a", range(1, 9), max_tokens=12), _req("b", range(1, 9), max_tokens=12)
    sim.add(SequenceGroup(a.name, [a]))
    sim.add(SequenceGroup(b.name, [b]))
    sim.run()
    assert sched.num_preemptions > 0 and sched.kv.host_pool.num_used == 0
    assert b.num_preemptions > 0


def test_resumed_group_is_not_preempted_again_before_it_samples():
    sched = _scheduler(num_blocks=9, budget=64, mode="swap")
    sim = _Sim(sched)
    groups = [SequenceGroup(f"r{i}", [_req(f"r{i}", range(1 + i, 8 + i), max_tokens=14)])
              for i in range(3)]
    for group in groups:
        sim.add(group)
    sim.run()
    assert sched.num_preemptions > 1
    assert sim.thrashes == 0


def _shared_prefix_workload(sim: _Sim, rng: random.Random, num: int) -> None:
    """Single streams whose prompts start with one of two system prompts of 3 blocks."""
    system = [[rng.randrange(1, 40) for _ in range(3 * BLOCK)] for _ in range(2)]
    for i in range(num):
        prompt = rng.choice(system)[:rng.randint(BLOCK, 3 * BLOCK)] + [
            rng.randrange(1, 40) for _ in range(rng.randint(1, 6))]
        root = _req(f"g{i}", prompt, max_tokens=rng.randint(2, 6))
        sim.add(SequenceGroup(root.name, [root]))


def _recorded_steps(sched: Scheduler, seed: int, workload=_random_workload) -> list[tuple]:
    """Every step of a seeded random workload, as plain values: what ran, with which blocks,
    what was preempted and which block moves were queued."""
    sim = _Sim(sched)
    workload(sim, random.Random(seed), num=16)
    steps = []
    while sched.has_unfinished:
        out = sim.step()
        steps.append((
            [(s.seq.name, s.num_computed_tokens, s.num_new_tokens, tuple(s.block_ids),
              s.num_sample_positions, s.draft_token_ids) for s in out.scheduled],
            [s.name for s in out.preempted], out.block_ops, out.num_prompt_tokens))
    return steps


@pytest.mark.parametrize("partial_prefills", [1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_decode_fast_path_schedules_as_the_general_path(monkeypatch, seed, partial_prefills):
    """``_decode_in_place`` only shortcuts what ``_schedule_group`` would do: with it turned
    off, the same workload (forks, beams, preemption by swap and recompute, prefix sharing)
    schedules the same chunks with the same blocks at every step."""
    def scheduler():
        kv = KVCacheManager(14, BLOCK, enable_caching=True, num_host_blocks=32)
        return Scheduler(SchedulerConfig(
            max_num_seqs=12, max_num_batched_tokens=16, max_model_len=256,
            enable_chunked_prefill=True, preemption_mode="auto", watermark=0.0,
            max_num_partial_prefills=partial_prefills, long_prefill_token_threshold=6), kv)

    taken = []
    fast = Scheduler._decode_in_place
    monkeypatch.setattr(Scheduler, "_decode_in_place",
                        lambda self, group, out: taken.append(fast(self, group, out))
                        or taken[-1])
    with_fast_path = _recorded_steps(scheduler(), seed)
    monkeypatch.setattr(Scheduler, "_decode_in_place", lambda self, group, out: False)
    assert _recorded_steps(scheduler(), seed) == with_fast_path
    assert sum(taken) > 20 and not all(taken)  # both paths ran


class _EveryRoot:
    """The shared-prefix rule as first written: compare ``seq`` with every prefilling root,
    reading each root's progress when asked."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.roots = block_size, []

    def add(self, root: Sequence) -> None:
        self.roots.append(root)

    def computes_next_block_of(self, seq: Sequence) -> bool:
        for other in self.roots:
            end = (other.num_computed_tokens // self.block_size + 1) * self.block_size
            if (end <= min(seq.num_prompt_tokens, other.num_prompt_tokens)
                    and seq.cache_key == other.cache_key
                    and seq.prompt_token_ids[:end] == other.prompt_token_ids[:end]):
                return True
        return False

    def copy(self) -> "_EveryRoot":
        twin = _EveryRoot(self.block_size)
        twin.roots = list(self.roots)
        return twin


@pytest.mark.parametrize("seed", range(6))
def test_prefill_index_follows_prefills_as_comparing_every_root(monkeypatch, seed):
    """``_PrefillIndex`` holds each root's next block as of when it was added: the same
    workload (prompts sharing system prompts, preempted under a small pool) schedules the
    same steps as with the rule that compares every root at its progress when asked."""
    from pagedserve.core import scheduler as scheduler_module

    def scheduler():
        kv = KVCacheManager(14, BLOCK, enable_caching=True, num_host_blocks=32)
        return Scheduler(SchedulerConfig(
            max_num_seqs=12, max_num_batched_tokens=16, max_model_len=256,
            enable_chunked_prefill=True, preemption_mode="auto", watermark=0.0,
            max_num_partial_prefills=3, long_prefill_token_threshold=6), kv)

    follows = []
    rule = Scheduler._follows_a_prefill
    monkeypatch.setattr(Scheduler, "_follows_a_prefill", lambda self, seq, prefilling:
                        follows.append(rule(self, seq, prefilling)) or follows[-1])
    indexed = _recorded_steps(scheduler(), seed, _shared_prefix_workload)
    monkeypatch.setattr(scheduler_module, "_PrefillIndex", _EveryRoot)
    assert _recorded_steps(scheduler(), seed, _shared_prefix_workload) == indexed
    assert any(follows)  # the rule held some prompts back
