"""The engine thread behind the server: failures stay contained and KV blocks come back."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
    NewRequest,
)
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import APIError
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.serving_models import EngineClient

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(chat_model):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(
        model=str(chat_model), device="cpu", max_model_len=256, kv_cache_memory_bytes=1 << 20)))
    engine.start()
    yield engine
    engine.shutdown()


async def _until_idle(engine: AsyncLLMEngine, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.stats.blocks_used or engine.stats.num_running or engine.stats.num_waiting:
        assert asyncio.get_running_loop().time() < deadline, engine.stats
        await asyncio.sleep(0.02)


def test_step_failure_fails_requests_in_flight_then_serving_resumes(engine):
    runner = engine.engine.runner
    real_execute = runner.execute
    failed = []

    def execute_failing_once(out, meta, *rest):
        # Fail the first step that runs both requests, after blocks were allocated for it.
        if not failed and len(out.scheduled) == 2:
            failed.append(True)
            raise RuntimeError("device on fire")
        return real_execute(out, meta)

    runner.execute = execute_failing_once

    async def main() -> None:
        streams = [await engine.add_request(i, [5, 6, 7 + len(i)], LONG) for i in ("a", "b")]
        for stream in streams:
            with pytest.raises(EngineStepError, match="device on fire"):
                async for _ in stream:
                    pass
        await _until_idle(engine)
        stream = await engine.add_request("c", [5, 6, 7], SamplingParams(max_tokens=5))
        outputs = [o async for o in stream]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 5

    asyncio.run(main())
    assert failed and engine.is_running
    assert engine.engine.kv.pool.num_used == 0


def test_closing_a_stream_aborts_and_rejections_stay_local(engine):
    async def main() -> None:
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("bad", [], SamplingParams())
        with pytest.raises(ValueError, match="token ids"):
            await engine.add_request("bad", [10**6], SamplingParams())
        stream = await engine.add_request("a", [5, 6, 7], LONG)
        first = await anext(stream)
        assert not first.finished
        stream.close()
        await _until_idle(engine)
        # The aborted id is free again, and the engine still answers.
        stream = await engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3))
        assert [o async for o in stream][-1].outputs[0].finish_reason == "length"

    asyncio.run(main())
    assert engine.engine.kv.pool.num_used == 0


def test_after_shutdown_requests_are_refused(engine):
    engine.shutdown()

    async def main() -> None:
        with pytest.raises(EngineDeadError):
            await engine.add_request("a", [5, 6, 7], SamplingParams())

    asyncio.run(main())


def _count_steps(engine: AsyncLLMEngine, hold_first: threading.Event | None = None) -> list:
    """Counts the engine's steps; with ``hold_first`` the first step waits until it is set."""
    steps = []
    real_step = engine.engine.step

    def step():
        if hold_first is not None and not steps:
            hold_first.wait(30)
        steps.append(len(engine.engine.scheduler.waiting))
        return real_step()

    engine.engine.step = step
    return steps


def test_all_prompts_of_a_request_enter_the_same_step(engine):
    """A completions request with many prompts is one command: a prompt per step made 128
    prompts five times slower than 128 separate requests."""
    steps = _count_steps(engine)
    client = EngineClient(engine, ServerMetrics(lambda: engine.stats))

    async def main() -> None:
        prompts = [[5, 6, 7 + i] for i in range(64)]
        streams = await client.submit_all("batch", prompts, ONE, 0.0, str)
        finals = await asyncio.gather(*(s.final() for s in streams))
        assert all(len(f.outputs[0].token_ids) == 1 for f in finals)

    asyncio.run(main())
    assert steps == [64]  # one step, which found all 64 waiting


def test_a_refused_prompt_in_a_batch_starts_none_of_them(engine):
    client = EngineClient(engine, ServerMetrics(lambda: engine.stats))

    async def main() -> None:
        with pytest.raises(ValueError, match="token ids"):
            await engine.add_requests([NewRequest(f"r{i}", [5, 6, 7], LONG) for i in range(3)]
                                      + [NewRequest("bad", [10**6], LONG)])
        with pytest.raises(APIError) as excinfo:
            await client.submit_all("x", [[5, 6], []], ONE, 0.0, str)
        assert excinfo.value.info.param == "prompt"
        await _until_idle(engine)
        # The refused batch's ids are free again.
        streams = await engine.add_requests([NewRequest(f"r{i}", [5, 6, 7], ONE)
                                             for i in range(3)])
        finals = await asyncio.gather(*(_last(s) for s in streams))
        assert [f.outputs[0].finish_reason for f in finals] == ["length"] * 3

    asyncio.run(main())
    assert engine.engine.kv.pool.num_used == 0


def test_requests_queued_during_a_step_all_enter_the_next_one(engine):
    release = threading.Event()
    steps = _count_steps(engine, hold_first=release)

    async def main() -> None:
        first = await engine.add_request("first", [5, 6, 7], SamplingParams(max_tokens=2))
        adds = [asyncio.ensure_future(engine.add_request(f"r{i}", [5, 6, 8 + i], ONE))
                for i in range(16)]
        await asyncio.sleep(0.2)  # every add has queued its command by now
        release.set()
        streams = [first, *await asyncio.gather(*adds)]
        await asyncio.gather(*(_last(s) for s in streams))

    asyncio.run(main())
    assert steps == [1, 16]  # "first" alone, then all 16 at once


async def _last(stream):
    return [output async for output in stream][-1]
