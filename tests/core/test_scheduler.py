from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.sampling_params import SamplingParams

BLOCK = 4


def _scheduler(num_blocks=64, budget=32, max_seqs=8, chunked=True, caching=False):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          max_model_len=256, enable_chunked_prefill=chunked, watermark=0.0)
    return Scheduler(cfg, kv)


def _req(rid, n, max_tokens=8):
    return Request(rid, list(range(1, n + 1)), SamplingParams(), max_tokens=max_tokens)


def _step(sched, token=7):
    """One engine step without a model: every sampling request gets ``token``."""
    out = sched.schedule()
    sched.advance(out)
    for item in out.scheduled:
        if item.samples:
            item.request.append_output(token)
            if item.request.num_output_tokens >= item.request.max_tokens:
                sched.finish(item.request, RequestStatus.FINISHED_LENGTH)
    return out


def test_prefill_and_decode_share_a_step():
    sched = _scheduler()
    a = _req("a", 5)
    sched.add_request(a)
    _step(sched)
    sched.add_request(_req("b", 6))
    out = _step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1),
                                                                                 ("b", 6)]


def test_long_prompt_is_chunked_under_the_budget():
    sched = _scheduler(budget=8)
    sched.add_request(_req("a", 20))
    chunks = [_step(sched).scheduled[0].num_new_tokens for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert _step(sched).scheduled[0].samples


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = _scheduler(budget=8, chunked=False)
    sched.add_request(_req("a", 8))
    sched.add_request(_req("b", 8))
    out = _step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a"]


def test_max_num_seqs_caps_the_batch():
    sched = _scheduler(max_seqs=2)
    for i in range(4):
        sched.add_request(_req(f"r{i}", 3))
    assert len(_step(sched).scheduled) == 2
    assert len(sched.waiting) == 2


def test_finished_request_returns_blocks_at_once():
    sched = _scheduler()
    a = _req("a", 5, max_tokens=1)
    sched.add_request(a)
    _step(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert sched.kv.pool.num_free == sched.kv.num_blocks


def test_pool_exhaustion_preempts_newest_and_everyone_finishes():
    sched = _scheduler(num_blocks=6, budget=64)
    reqs = [_req(f"r{i}", 6, max_tokens=10) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
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
    a, b = _req("a", 4), _req("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished
    assert sched.kv.pool.num_free == sched.kv.num_blocks


def test_max_tokens_0_computes_the_prompt_once_and_nothing_after():
    """Prompt scoring: the prompt runs (its last chunk samples, and the engine drops that
    token), then the stream is never scheduled again, ahead of the host or not."""
    for pending in (False, True):
        sched = _scheduler(budget=8)
        a = _req("a", 12, max_tokens=0)
        sched.add_request(a)
        chunks = []
        for _ in range(3):
            out = sched.schedule(schedule_pending=pending)
            sched.advance(out)
            chunks += [(s.num_new_tokens, s.samples) for s in out.scheduled]
        assert chunks == [(8, False), (4, True)]
