from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedserve.sampling_params import SamplingParams
from tests.kv_checks import sample_without_model

BLOCK = 4


def _scheduler(num_blocks=64, budget=32, max_seqs=8, chunked=True, caching=False):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          max_model_len=256, enable_chunked_prefill=chunked,
                          preemption_mode="auto", watermark=0.0)
    return Scheduler(cfg, kv)


def _req(n, max_tokens=8):
    return Sequence(list(range(1, n + 1)), SamplingParams(), max_tokens=max_tokens)


def _add(sched, seq):
    sched.add_group(SequenceGroup("request", [seq]))


def _step(sched, token=7):
    """One engine step without a model: every sampling request gets ``token``."""
    out = sched.schedule()
    sample_without_model(sched, out, token)
    return out


def test_prefill_and_decode_share_a_step():
    sched = _scheduler()
    a, b = _req(5), _req(6)
    _add(sched, a)
    _step(sched)
    _add(sched, b)
    out = _step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 6)]


def test_long_prompt_is_chunked_under_the_budget():
    sched = _scheduler(budget=8)
    _add(sched, _req(20))
    chunks = [_step(sched).scheduled[0].num_new_tokens for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert _step(sched).scheduled[0].num_sample_positions


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = _scheduler(budget=8, chunked=False)
    a, b = _req(8), _req(8)
    _add(sched, a)
    _add(sched, b)
    out = _step(sched)
    assert [s.seq for s in out.scheduled] == [a]


def test_max_num_seqs_caps_the_batch():
    sched = _scheduler(max_seqs=2)
    for _ in range(4):
        _add(sched, _req(3))
    assert len(_step(sched).scheduled) == 2
    assert len(sched.waiting) == 2


def test_finished_request_returns_blocks_at_once():
    sched = _scheduler()
    a = _req(5, max_tokens=1)
    _add(sched, a)
    _step(sched)
    assert a.status is SequenceStatus.FINISHED_LENGTH
    assert sched.kv.pool.num_free == sched.kv.num_blocks


def test_pool_exhaustion_preempts_newest_and_everyone_finishes():
    sched = _scheduler(num_blocks=6, budget=64)
    reqs = [_req(6, max_tokens=10) for i in range(3)]
    for r in reqs:
        _add(sched, r)
    for _ in range(200):
        if not sched.has_unfinished:
            break
        out = _step(sched)
        for victim in out.preempted:
            assert victim.num_computed_tokens == 0 and victim.group in sched.waiting
    assert not sched.has_unfinished
    assert all(r.num_output_tokens == 10 for r in reqs)
    assert sched.num_preemptions > 0
    assert sched.kv.pool.num_free == 6


def test_abort_waiting_and_running():
    sched = _scheduler(max_seqs=1)
    a, b = _req(4), _req(4)
    _add(sched, a)
    _add(sched, b)
    _step(sched)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished
    assert sched.kv.pool.num_free == sched.kv.num_blocks


def test_max_tokens_0_computes_the_prompt_once_and_nothing_after():
    """Prompt scoring: the prompt runs (its last chunk samples, and the engine drops that
    token), then the stream is never scheduled again, ahead of the host or not."""
    for pending in (False, True):
        sched = _scheduler(budget=8)
        _add(sched, _req(12, max_tokens=0))
        chunks = []
        for _ in range(3):
            out = sched.schedule(schedule_pending=pending)
            sched.advance(out)
            chunks += [(s.num_new_tokens, s.num_sample_positions) for s in out.scheduled]
        assert chunks == [(8, False), (4, True)]
