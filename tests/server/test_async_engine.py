"""The engine thread behind the server: failures stay contained and KV blocks come back."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


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
