"""Verify steps in the scheduler: a decoding stream with drafts computes its last token and
the drafts in one chunk and samples at each of them; the budget and max_tokens cap the drafts;
``take_back`` returns the rejected drafts' slots, and none of them is ever hashed."""

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.sequence import Sequence, SequenceGroup
from pagedserve.sampling_params import SamplingParams
from tests.kv_checks import check_pools

BLOCK = 4


def _scheduler(budget=32, caching=True, num_blocks=32):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=caching)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                          enable_chunked_prefill=True, preemption_mode="auto", watermark=0.0)
    return Scheduler(cfg, kv)


def _decoding(sched, prompt_len=6, max_tokens=20):
    """A stream whose prompt is computed and whose first token is sampled and appended."""
    seq = Sequence(list(range(1, prompt_len + 1)), SamplingParams(), max_tokens=max_tokens)
    sched.add_group(SequenceGroup("r", [seq]))
    out = sched.schedule()
    sched.advance(out)
    seq.append_output(100)
    return seq


def test_a_stream_with_drafts_verifies_them_in_one_chunk():
    sched = _scheduler()
    seq = _decoding(sched)
    seq.draft_token_ids = [101, 102, 103]
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.num_sample_positions) == (6, 4, 4)
    assert item.draft_token_ids == (101, 102, 103) and seq.draft_token_ids == []
    assert len(item.block_ids) == 3  # 10 slots of 4
    sched.advance(out)
    assert seq.num_pending_tokens == 4 and seq.num_computed_tokens == 10
    # One draft accepted, then the target's token: two appended, two drafts rejected.
    seq.append_output(101)
    seq.append_output(200)
    sched.take_back(seq, 2)
    assert (seq.num_computed_tokens, seq.num_pending_tokens) == (8, 0)
    assert len(sched.kv.block_table(seq)) == 2
    check_pools(sched.kv)
    # The next step computes the target's token, the stream's last: the prefix is intact.
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.num_sample_positions) == (8, 1, 1)


def test_the_budget_and_max_tokens_cap_the_drafts():
    sched = _scheduler(budget=3)
    seq = _decoding(sched, prompt_len=3)
    seq.draft_token_ids = [1, 2, 3, 4, 5]
    (item,) = sched.schedule().scheduled
    assert item.num_new_tokens == 3 and item.draft_token_ids == (1, 2)
    sched = _scheduler()
    seq = _decoding(sched, max_tokens=3)  # one token out: at most two more
    seq.draft_token_ids = [1, 2, 3, 4]
    (item,) = sched.schedule().scheduled
    assert item.draft_token_ids == (1,) and item.num_sample_positions == 2


def test_a_prefill_chunk_carries_no_drafts():
    sched = _scheduler(budget=4)
    seq = Sequence(list(range(1, 11)), SamplingParams(), max_tokens=8)
    seq.draft_token_ids = [1, 2]
    sched.add_group(SequenceGroup("r", [seq]))
    (item,) = sched.schedule().scheduled
    assert item.draft_token_ids == () and item.num_sample_positions == 0


def test_rejected_drafts_are_never_found_in_the_prefix_cache():
    """Drafts that would complete a block are computed, rejected and taken back: a new
    request with those tokens finds only the blocks of accepted tokens."""
    sched = _scheduler()
    seq = _decoding(sched, prompt_len=6)  # 6 prompt + 1 output; blocks [1-4], [5,6,100,.]
    seq.draft_token_ids = [7, 8, 9, 10, 11]  # would fill block 2 and most of block 3
    out = sched.schedule()
    sched.advance(out)
    seq.append_output(300)  # the first draft rejected: the target's token instead
    sched.take_back(seq, 5)
    check_pools(sched.kv)
    probe = Sequence([1, 2, 3, 4, 5, 6, 100, 7, 8, 9, 10, 11, 0], SamplingParams(),
                     max_tokens=1)
    assert len(sched.kv.find_cached_prefix(probe)) == 1  # only [1, 2, 3, 4]
    # Once the accepted tokens fill block 2, it is found, with the accepted token in it.
    seq.draft_token_ids = []
    for token in (301, 302):
        out = sched.schedule()
        sched.advance(out)
        seq.append_output(token)
    sched.advance(sched.schedule())  # computes 302, allocating (and hashing) what is full
    accepted = Sequence([1, 2, 3, 4, 5, 6, 100, 300, 0], SamplingParams(), max_tokens=1)
    assert len(sched.kv.find_cached_prefix(accepted)) == 2
