"""Taking back a sequence's last slots (``KVCacheManager.trim``, for rejected draft tokens) and
the commit rule of the prefix cache: only accepted tokens' blocks are ever findable."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedserve.core.block_hash import hash_full_blocks
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.sequence import Sequence, SequenceGroup
from pagedserve.sampling_params import SamplingParams
from tests.kv_checks import SimulatedCache, assert_pools_full, check_pools

BLOCK = 4


def _seq(tokens: list[int]) -> Sequence:
    return Sequence(list(tokens), SamplingParams(), max_tokens=64)


def _computed(kv: KVCacheManager, tokens: list[int]) -> Sequence:
    """A sequence whose tokens are all in the cache, its prefix taken from it where it can."""
    seq = _seq(tokens)
    cached = kv.find_cached_prefix(seq)
    assert kv.allocate_slots(seq, len(tokens) - len(cached) * BLOCK, cached)
    seq.num_computed_tokens = len(tokens)
    return seq


def _hits(kv: KVCacheManager, tokens: list[int]) -> list[int]:
    """The blocks a new request for ``tokens`` (and one token more) takes from the cache."""
    return kv.find_cached_prefix(_seq(tokens + [0]))


def test_trim_returns_the_blocks_past_the_kept_length_and_only_unreferences_shared_ones():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    a = _computed(kv, list(range(1, 11)))  # two full blocks, one partial
    a0, a1, _ = kv.block_table(a)
    b = _computed(kv, list(range(1, 9)) + [50, 51, 52])  # shares a0 and a1
    assert kv.block_table(b)[:2] == [a0, a1]
    assert kv.allocate_slots(b, 6)  # room for six draft tokens: 17 slots, five blocks
    b2, b3, b4 = kv.block_table(b)[2:]
    free_before = kv.pool.num_free

    assert kv.trim(b, 6) == [b2, b3, b4]

    assert kv.block_table(b) == [a0, a1]
    assert [kv.pool.ref_counts[x] for x in (a0, a1, b2, b3, b4)] == [2, 2, 0, 0, 0]
    assert {b2, b3, b4} <= set(kv.pool._free) and kv.pool.num_free == free_before + 3
    # a1 is partly b's now but still full for a: it stays findable, and b copies it before
    # writing into it.
    assert _hits(kv, list(range(1, 9))) == [a0, a1]
    assert kv._hashes[b] == kv._hashes[a][:1]
    b.num_computed_tokens = 6
    assert kv.allocate_slots(b, 1)
    copy = kv.block_table(b)[1]
    assert kv.take_block_ops().copies == [(a1, copy)]
    assert kv.pool.ref_counts[a1] == 1 and _hits(kv, list(range(1, 9))) == [a0, a1]
    check_pools(kv)


def test_a_private_block_left_partly_filled_is_no_longer_findable_even_after_a_swap():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, num_host_blocks=8)
    tokens = list(range(1, 13))
    a = _computed(kv, tokens)  # three full blocks, all findable
    a0, a1, a2 = kv.block_table(a)
    assert _hits(kv, tokens) == [a0, a1, a2]

    assert kv.trim(a, 6) == [a2]
    a.num_computed_tokens = 6

    assert kv.pool.ref_counts[a2] == 0 and a2 in kv.pool._free
    assert _hits(kv, tokens) == [a0]  # a1 will be written again from slot 6 on
    kv.swap_out([a])
    kv.swap_in([a])  # re-registers only the hashes a still has
    assert len(_hits(kv, tokens)) == 1
    check_pools(kv)


def test_trimming_a_forked_stream_frees_its_copy_and_leaves_the_parent_intact():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    cache = SimulatedCache(kv)
    parent = _computed(kv, list(range(1, 7)))  # p0 full, p1 half full
    cache.write(parent, kv.block_table(parent), 0, 6)
    p0, p1 = kv.block_table(parent)
    child = parent.fork()
    kv.fork(parent, child)
    for token in (40, 41, 42):
        child.append_output(token)
    assert kv.allocate_slots(child, 3)  # copy-on-write of p1, then one fresh block
    cache.apply(kv.take_block_ops())
    cache.write(child, kv.block_table(child), 6, 3)
    _, c1, c2 = kv.block_table(child)
    assert c1 != p1

    assert kv.trim(child, 4) == [c1, c2]

    assert [kv.pool.ref_counts[x] for x in (p0, p1, c1, c2)] == [2, 1, 0, 0]
    assert kv.pool.num_free == 8 - 2
    cache.check_sequence(parent)
    check_pools(kv)


def test_rejected_draft_tokens_never_enter_the_prefix_cache():
    """Schedule a prompt and room for drafts, write the drafts, accept one and trim the rest:
    looking the drafts up finds nothing, and a block is findable once its tokens are accepted
    and committed."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    cache = SimulatedCache(kv)
    seq = _seq([1, 2, 3, 4, 5, 6])
    drafts = [70, 71, 72, 73, 74, 75]
    assert kv.allocate_slots(seq, 6 + len(drafts))  # 12 slots: the drafts fill blocks 1, 2
    cache.write(seq, kv.block_table(seq), 0, 6)
    _write(cache, kv.block_table(seq), 6, drafts)
    assert _hits(kv, [1, 2, 3, 4, 5, 6] + drafts) == kv.block_table(seq)[:1]

    seq.append_output(drafts[0])  # the first draft is accepted, the rest rejected
    seq.num_computed_tokens = 7
    removed = kv.trim(seq, 7)
    kv.cache_full_blocks(seq, 7)
    assert len(removed) == 1 and kv.pool.ref_counts[removed[0]] == 0
    assert _hits(kv, [1, 2, 3, 4, 5, 6] + drafts) == kv.block_table(seq)[:1]

    seq.append_output(80)  # block 1 now holds accepted tokens only: 5, 6, 70, 80
    assert kv.allocate_slots(seq, 1)
    cache.write(seq, kv.block_table(seq), 7, 1)
    seq.num_computed_tokens = 8
    kv.cache_full_blocks(seq, 8)
    assert _hits(kv, [1, 2, 3, 4, 5, 6, 70, 80]) == kv.block_table(seq)
    assert _hits(kv, [1, 2, 3, 4, 5, 6] + drafts) == kv.block_table(seq)[:1]
    check_pools(kv)


def test_a_block_completed_by_an_in_flight_token_is_found_once_that_token_is_accepted():
    """Async scheduling computes a sampled token before the host has it: the block it
    completes enters the prefix cache only once the token is appended and committed."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                          enable_chunked_prefill=True, preemption_mode="auto", watermark=0.0)
    sched = Scheduler(cfg, kv)
    seq = _seq([1, 2, 3, 4, 5, 6, 7])
    sched.add_group(SequenceGroup("r", [seq]))
    sched.advance(sched.schedule(schedule_pending=True))
    out = sched.schedule(schedule_pending=True)  # computes slot 7 with the token in flight
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(7, 1)]
    sched.advance(out)
    table = kv.block_table(seq)
    assert _hits(kv, [1, 2, 3, 4, 5, 6, 7, 9]) == table[:1]
    seq.append_output(9)
    kv.cache_full_blocks(seq, seq.num_computed_tokens)
    assert _hits(kv, [1, 2, 3, 4, 5, 6, 7, 9]) == table[:2]


def _write(cache: SimulatedCache, table: list[int], start: int, tokens: list[int]) -> None:
    """Write tokens the sequence does not hold (drafts) into its slots."""
    for pos, token in enumerate(tokens, start):
        cache.device[table[pos // BLOCK]][pos % BLOCK] = token


class DraftMachine(RuleBasedStateMachine):
    """Prompts (with prefix hits), forks, decode steps, steps with draft tokens of which a
    random number is accepted and the rest trimmed, rollbacks and frees, in random orders.
    Ref counts stay exact, each stream reads back its own computed tokens, and every findable
    block holds exactly the accepted tokens its hash names, never a rejected draft."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=BLOCK)
        self.cache = SimulatedCache(self.kv)
        self.live: list[Sequence] = []
        self.contents: dict[bytes, list[int]] = {}  # block hash -> the tokens it names

    def _pick(self, index: int) -> Sequence | None:
        return self.live[index % len(self.live)] if self.live else None

    def _compute(self, seq: Sequence, num: int) -> bool:
        if not self.kv.allocate_slots(seq, num):
            return False
        self.cache.apply(self.kv.take_block_ops())
        self.cache.write(seq, self.kv.block_table(seq), seq.num_computed_tokens, num)
        seq.num_computed_tokens += num
        return True

    def _drop(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.live.remove(seq)

    @rule(length=st.integers(1, 10), vocab=st.integers(1, 3))
    def new(self, length, vocab):
        seq = _seq([(i * 7 + vocab) % (vocab + 2) for i in range(length)])
        cached = self.kv.find_cached_prefix(seq)
        num_cached = len(cached) * BLOCK
        if not self.kv.allocate_slots(seq, length - num_cached, cached):
            return
        self.cache.apply(self.kv.take_block_ops())
        self.cache.write(seq, self.kv.block_table(seq), num_cached, length - num_cached)
        seq.num_computed_tokens = length
        self.live.append(seq)

    @rule(index=st.integers(0, 15))
    def fork(self, index):
        parent = self._pick(index)
        if parent is not None:
            child = parent.fork()
            self.kv.fork(parent, child)
            self.live.append(child)

    @rule(index=st.integers(0, 15), token=st.integers(1, 3))
    def decode(self, index, token):
        seq = self._pick(index)
        if seq is None:
            return
        seq.append_output(token)
        if not self._compute(seq, seq.num_tokens - seq.num_computed_tokens):
            self._drop(seq)

    @rule(index=st.integers(0, 15), drafts=st.lists(st.integers(1, 3), min_size=1, max_size=6),
          num_accepted=st.integers(0, 6))
    def speculate(self, index, drafts, num_accepted):
        """One verify step: compute the drafts after the known tokens, accept a prefix of
        them, take back the slots of the rest and commit what was accepted."""
        seq = self._pick(index)
        if seq is None or seq.num_computed_tokens < seq.num_tokens:
            return
        start = seq.num_computed_tokens
        if not self.kv.allocate_slots(seq, len(drafts)):
            return
        self.cache.apply(self.kv.take_block_ops())
        _write(self.cache, self.kv.block_table(seq), start, drafts)
        accepted = drafts[:num_accepted]
        for token in accepted:
            seq.append_output(token)
        seq.num_computed_tokens = start + len(accepted)
        table = list(self.kv.block_table(seq))
        keep = self.kv.blocks_for(seq.num_computed_tokens)
        assert self.kv.trim(seq, seq.num_computed_tokens) == table[keep:]
        self.kv.cache_full_blocks(seq, seq.num_computed_tokens)

    @rule(index=st.integers(0, 15), back=st.integers(0, 9), token=st.integers(1, 3))
    def roll_back(self, index, back, token):
        """Take back accepted output tokens too, then decode ``token``: it may land where
        another token was (the core has no such call: the test edits the token lists)."""
        seq = self._pick(index)
        if seq is None:
            return
        num_tokens = max(seq.num_prompt_tokens, seq.num_tokens - back)
        del seq.output_token_ids[num_tokens - seq.num_prompt_tokens:]
        del seq.all_token_ids[num_tokens:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens - back % 2)
        self.kv.trim(seq, seq.num_computed_tokens)
        self.decode(index, token)

    @rule(index=st.integers(0, 15))
    def free(self, index):
        seq = self._pick(index)
        if seq is not None:
            self._drop(seq)

    @invariant()
    def refs_contents_and_prefix_cache(self):
        check_pools(self.kv)
        for seq in self.live:
            self.cache.check_sequence(seq)
            for block_hash, first in zip(hash_full_blocks(seq.all_token_ids, BLOCK),
                                         range(0, seq.num_tokens, BLOCK)):
                self.contents[block_hash] = seq.all_token_ids[first:first + BLOCK]
        for block_hash, block in self.kv.pool._block_of.items():
            assert block_hash in self.contents, "a block is findable under a hash no accepted " \
                "prefix has"
            assert self.cache.device[block] == self.contents[block_hash], \
                f"block {block} is findable but holds other tokens"

    def teardown(self):
        for seq in self.live:
            self.kv.free(seq)
        check_pools(self.kv)
        assert_pools_full(self.kv)


DraftMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
test_random_drafts_and_trims_keep_refs_exact_and_the_cache_accepted_only = \
    DraftMachine.TestCase
