"""The API server's client of a real engine-core process: outputs built from its deltas
equal the offline engine's, bad requests are refused before they are sent, closing a stream
frees the request's blocks in the core, and a stopped core refuses work."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedserve import LLM
from pagedserve.config import EngineConfig
from pagedserve.engine.core_client import (
    EngineCoreClient,
    EngineDeadError,
    EngineStartError,
    _socket_folder,
)
from pagedserve.engine.core_messages import NewRequest
from pagedserve.sampling_params import InvalidSamplingParam, SamplingParams
from tests.tiny_models import write_tiny_model

ENGINE = dict(device="cpu", max_model_len=1024, kv_cache_memory_bytes=1 << 20)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama3"), "llama3")


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def client(tiny_model, loop):
    client = EngineCoreClient(EngineConfig(model=str(tiny_model), **ENGINE))
    client.start()
    client.run_in(loop)
    yield client
    loop.run_until_complete(client.shutdown())


def _delta(**kwargs) -> SamplingParams:
    return SamplingParams(output_kind="delta", **kwargs)


async def _final(stream):
    last = None
    async for output in stream:
        last = output
    return last


async def _until_idle(client: EngineCoreClient, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while client.stats.blocks_used or client.stats.num_running or client.stats.num_waiting:
        assert asyncio.get_running_loop().time() < deadline, client.stats
        await asyncio.sleep(0.02)


def test_outputs_equal_the_offline_engine(client, loop, tiny_model):
    prompts = [[5, 6, 7 + i] for i in range(6)]
    kinds = [dict(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
             dict(n=2, max_tokens=9, temperature=0.8, seed=11, ignore_eos=True)]

    async def main():
        streams = client.add_requests([NewRequest(f"r{i}", p, _delta(**kinds[i % 2]))
                                       for i, p in enumerate(prompts)])
        return await asyncio.gather(*(_final(s) for s in streams))

    got = loop.run_until_complete(main())
    llm = LLM(model=str(tiny_model), **ENGINE)
    want = llm.generate(prompts, [SamplingParams(**kinds[i % 2]) for i in range(len(prompts))],
                        use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.finished
        assert [(o.index, o.text, o.token_ids, o.logprobs, o.finish_reason) for o in g.outputs] \
            == [(o.index, o.text, o.token_ids, o.logprobs, o.finish_reason) for o in w.outputs]
        assert [o.cumulative_logprob for o in g.outputs] == pytest.approx(
            [o.cumulative_logprob for o in w.outputs])


def test_bad_requests_are_refused_before_anything_is_sent(client, loop):
    with pytest.raises(InvalidSamplingParam) as err:
        client.add_requests([NewRequest("ok", [5, 6, 7], _delta(max_tokens=2)),
                             NewRequest("bad", [10**6], _delta())])
    assert err.value.param == "prompt"
    with pytest.raises(ValueError, match="empty"):
        client.add_requests([NewRequest("bad", [], _delta())])

    async def main():
        await _until_idle(client)
        # "ok" was never sent, so its id is free.
        return await _final(client.add_requests(
            [NewRequest("ok", [5, 6, 7], _delta(max_tokens=2))])[0])

    assert loop.run_until_complete(main()).outputs[0].finish_reason == "length"


def test_an_id_twice_in_one_batch_is_refused_before_anything_is_sent(client, loop):
    """The core refused the second and its failure took the first's place here: the first's
    stream never ended, though the core ran it to the end."""
    with pytest.raises(ValueError, match="'twice' is already in use"):
        client.add_requests([NewRequest("twice", [5, 6, 7], _delta(max_tokens=2)),
                             NewRequest("twice", [5, 6, 8], _delta(max_tokens=2))])

    async def main():
        await _until_idle(client)
        return await asyncio.wait_for(_final(client.add_requests(
            [NewRequest("twice", [5, 6, 7], _delta(max_tokens=2))])[0]), 60)

    assert loop.run_until_complete(main()).outputs[0].finish_reason == "length"


def test_closing_a_stream_frees_its_blocks_in_the_core(client, loop):
    async def main():
        # A thousand steps: still running when the test closes it, on any machine.
        stream = client.add_requests([NewRequest(
            "long", [5, 6, 7], _delta(max_tokens=1000, ignore_eos=True))])[0]
        first = await anext(stream)
        assert not first.finished
        while not client.stats.blocks_used:
            await asyncio.sleep(0.01)
        stream.close()
        await _until_idle(client)

    loop.run_until_complete(main())
    assert client.stats.blocks_used == 0


def test_after_shutdown_requests_are_refused(tiny_model, loop):
    client = EngineCoreClient(EngineConfig(model=str(tiny_model), **ENGINE))
    client.start()
    client.run_in(loop)
    loop.run_until_complete(client.shutdown())
    assert not client.is_running and not client._process.is_alive()
    with pytest.raises(EngineDeadError):
        client.add_requests([NewRequest("a", [5, 6, 7], _delta())])


def test_a_tmpdir_too_long_for_a_socket_path_still_serves(tiny_model, loop, tmp_path,
                                                          monkeypatch):
    """A Unix socket's path holds 107 bytes: under a TMPDIR this long the core's sockets
    could not be bound (ZMQError, a traceback at start-up); their folder goes in /tmp then,
    as multiprocessing's does, and is removed at shutdown."""
    long_tmpdir = tmp_path / ("t" * 90)
    long_tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmpdir))
    client = EngineCoreClient(EngineConfig(model=str(tiny_model), **ENGINE))
    client.start()
    folder = client._ipc_dir
    try:
        client.run_in(loop)
        final = loop.run_until_complete(_final(client.add_requests(
            [NewRequest("a", [5, 6, 7], _delta(max_tokens=2))])[0]))
        assert final.outputs[0].finish_reason == "length"
    finally:
        loop.run_until_complete(client.shutdown())
    assert folder.parent == Path("/tmp") and not folder.exists()
    assert list(long_tmpdir.iterdir()) == []


def test_no_folder_short_enough_for_the_sockets_is_a_one_line_start_error():
    with pytest.raises(EngineStartError, match="set a shorter one"):
        _socket_folder(20)


def test_a_request_that_cannot_be_sent_leaves_nothing_behind(client, loop):
    """A failure after the checks, here msgpack refusing an int past 64 bits, must not keep
    the request: each one stayed in the client for good, with its prompt (1,000 of them grew
    the API server by 300 MB), and its id could never be used again."""
    params = _delta(max_tokens=2)
    params.top_k = 2**64  # set after SamplingParams' own check, as a missed check would
    before = len(client._pending)
    for i in range(20):
        with pytest.raises(OverflowError):
            client.add_requests([NewRequest(f"unsent-{i}", [5, 6, 7], params)])
    assert len(client._pending) == before
    stream = client.add_requests([NewRequest("unsent-0", [5, 6, 7], _delta(max_tokens=2))])[0]
    assert loop.run_until_complete(_final(stream)).outputs[0].finish_reason == "length"
    assert len(client._pending) == before



def test_an_adapter_is_removed_after_its_last_request_ends(tiny_model):
    """``remove_lora`` waits for the adapter's requests in flight (one finishing, one aborted),
    refuses new ones meanwhile, and reaches the core after the abort it follows. No core runs:
    the commands are recorded."""
    from pagedserve import LoRARequest
    from pagedserve.engine import core_messages as msg

    client, sent = _recording_client(tiny_model)
    lora = LoRARequest("a", 3, "/adapter")
    requests = [NewRequest(r, [5, 6], _delta(), lora) for r in ("r1", "r2")]
    client.add_requests([*requests, NewRequest("base", [5, 6], _delta())])
    client.remove_lora(3)
    assert client.lora_in_use(3) and len(sent) == 1
    with pytest.raises(ValueError, match="LoRA adapter a is being removed"):
        client.add_requests([NewRequest("r3", [5], _delta(), lora)])
    core_ids = {r.request_id.partition("#")[0]: r.request_id for r in sent[0].requests}
    client._dispatch(_finished_delta(core_ids["r1"]))
    assert client.lora_in_use(3) and len(sent) == 1
    client.abort("r2")
    assert sent[1:] == [msg.AbortRequests([core_ids["r2"]]), msg.RemoveLoRA(3)]
    assert not client.lora_in_use(3)
    client.abort("base")  # the base model's requests never count
    assert sent[3:] == [msg.AbortRequests([core_ids["base"]])]


def _recording_client(tiny_model) -> tuple[EngineCoreClient, list]:
    """A client whose commands are recorded, not sent; no core runs."""
    client = EngineCoreClient(EngineConfig(model=str(tiny_model), **ENGINE))
    client._process = SimpleNamespace(is_alive=lambda: True)
    client.facts = SimpleNamespace(limits=SimpleNamespace(check=lambda *args: None,
                                                          check_priority=lambda *args: None))
    sent = []
    client._send = sent.append
    return client, sent


def _finished_delta(core_id: str):
    from pagedserve.engine import core_messages as msg

    done = msg.SequenceDelta(0, "x", [7], None, None, "length", None)
    return SimpleNamespace(outputs=[msg.RequestDelta(core_id, [done], True, None, None)],
                           failures=[], stats=None)


def test_outputs_of_a_closed_request_never_reach_a_new_one_of_its_id(tiny_model):
    """An id is free again once its stream closes, but the core's outputs of the closed
    request may still be on their way: they were added to the new request of that id (a
    three-token request came back with 4 to 7 tokens, 5 times in 20 against a real core)."""
    client, sent = _recording_client(tiny_model)
    client.add_requests([NewRequest("r", [5, 6], _delta())])[0].close()
    stream = client.add_requests([NewRequest("r", [5, 7], _delta())])[0]
    old, new = (command.requests[0].request_id for command in (sent[0], sent[2]))
    client._dispatch(_finished_delta(old))  # sent by the core before the abort reached it
    assert stream._queue.empty() and not stream.finished
    client._dispatch(_finished_delta(new))
    assert stream._queue.get_nowait().outputs[0].token_ids == [7]
    assert not client._pending
