"""The grammar compiler under a hostile schema: a compile over its time budget fails with a
named error, a slow compile does not hold up another grammar, and a compile nobody waits for
any more is stopped (its worker process killed).

The slow schema: 40 bounded strings compile for tens of seconds on the default model's
vocabulary (18 s on a quiet core), far beyond every budget set here; each test waits on the
futures and the pool's state, never on the clock."""

from __future__ import annotations

import json
import os
import time

import pytest

from pagedserve import SamplingParams, StructuredOutputsParams
from pagedserve.structured.compiler import GrammarCompilerPool, GrammarTooSlow
from pagedserve.structured.spec import GrammarSpec
from tests.kv_checks import assert_pools_full

SLOW = GrammarSpec("json", json.dumps({
    "type": "object", "required": [f"p{i}" for i in range(40)],
    "properties": {f"p{i}": {"type": "string", "maxLength": 50 + i} for i in range(40)}}))
FAST = GrammarSpec("json", json.dumps({
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string", "maxLength": 12}}}))


@pytest.fixture(scope="module")
def tokenizer(default_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_folder)


@pytest.fixture
def make_pool(tokenizer):
    pools = []

    def make(num_workers: int, timeout_s: float) -> GrammarCompilerPool:
        pools.append(GrammarCompilerPool(tokenizer, len(tokenizer), {tokenizer.eos_token_id},
                                         num_workers=num_workers, timeout_s=timeout_s))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_running(pool: GrammarCompilerPool, future) -> None:
    """Until the compile of ``future`` has reached a worker."""
    while pool._running[future].worker is None:
        time.sleep(0.01)


def test_a_grammar_over_the_time_budget_fails_with_a_named_error(make_pool):
    pool = make_pool(num_workers=1, timeout_s=0.5)
    error = pool.get(SLOW).exception()
    assert isinstance(error, GrammarTooSlow)
    assert error.param == "structured_outputs"
    assert "--max-grammar-compile-seconds" in str(error) and "0.5 s" in str(error)
    # The worker that timed out was replaced: the next grammar compiles on the fresh one.
    assert pool.get(FAST).result() is not None
    assert pool.get(SLOW).exception() is error  # a refused spec fails at once when asked again


def test_a_slow_grammar_does_not_hold_up_another(make_pool):
    pool = make_pool(num_workers=2, timeout_s=600)
    slow = pool.get(SLOW)
    _wait_running(pool, slow)
    assert pool.get(FAST).result() is not None
    assert not slow.done()  # the fast one finished while the slow one still compiles
    pool.release(slow)


def test_the_last_waiter_leaving_stops_the_compile(make_pool):
    pool = make_pool(num_workers=1, timeout_s=600)
    slow = pool.get(SLOW)
    assert pool.get(SLOW) is slow  # two requests wait on one compile
    _wait_running(pool, slow)
    worker = pool._running[slow].worker.pid
    pool.release(slow)
    assert not slow.done() and _alive(worker)  # one request still waits
    pool.release(slow)
    assert slow.cancelled() and pool.num_compiling == 0
    assert not _alive(worker)  # killed and reaped
    # The one worker is free again (a fresh process): a new grammar compiles at once.
    assert pool.get(FAST).result() is not None


def test_aborting_a_request_stops_its_compile(default_llm):
    engine = default_llm.engine
    request_id = engine.add_request("x", SamplingParams(
        structured_outputs=StructuredOutputsParams(json=json.loads(SLOW.text))))
    future = engine._awaiting_grammar[request_id][1]
    engine.abort_request(request_id)
    assert future.cancelled()
    assert engine.grammars.num_compiling == 0
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert_pools_full(engine.kv)


_DROP_SCRIPT = """
import gc, json, os, sys
import psutil
from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams

def workers():
    return sorted(p.pid for p in psutil.Process().children()
                  if "pagedserve.structured.compiler" in " ".join(p.cmdline()))

def alive(pid):
    try:
        os.kill(pid, 0)
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False

llm = LLM(model=sys.argv[1], device="cpu", max_model_len=256, kv_cache_memory_bytes=1 << 20)
params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
    choice=["red", "green"]))
text = llm.generate(["pick"], params, use_tqdm=False)[0].outputs[0].text
started, expected = workers(), llm.engine.config.grammar_compile_workers
del llm
gc.collect()
print(json.dumps({"text": text, "started": started, "expected": expected,
                  "alive": [pid for pid in started if alive(pid)]}))
"""


def test_dropping_an_engine_stops_its_compile_workers(tmp_path):
    """The pool's threads keep the pool alive, so only the engine's finalizer can stop the
    worker processes of an engine nobody holds any more. In a process of its own, so that no
    other engine's pool (a test's before, restarting a worker it killed) adds children."""
    import json
    import subprocess
    import sys

    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "m", "llama3")
    run = subprocess.run([sys.executable, "-c", _DROP_SCRIPT, str(folder)], capture_output=True,
                         text=True, timeout=120, check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["text"] in ("red", "green")
    assert len(result["started"]) == result["expected"]
    assert result["alive"] == []
