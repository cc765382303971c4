"""The KV offloading benchmarks' own logic: the order ``bench kv-offload`` sends the turns in
(a fake engine that answers one request per step, so the order is the driver's alone), and
``bench kv-copy-rate``'s check that the timed copies moved the right bytes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedserve.bench.kv_copy_rate import _Bench, kv_layout, measure
from pagedserve.bench.kv_offload import Conversations, run
from pagedserve.config import EngineConfig


class OneAtATime:
    """Finishes the oldest request each step (so requests finish in the order they were
    sent), answering ``[7, 7]``; records how many requests were in the engine as each
    arrived."""

    def __init__(self) -> None:
        self.queue, self.in_engine = [], []

    def add_request(self, prompt, params):
        request_id = str(len(self.in_engine))
        self.in_engine.append(len(self.queue))
        self.queue.append(request_id)
        return request_id

    def step(self):
        request_id = self.queue.pop(0)
        metrics = SimpleNamespace(arrival_time=0.0, first_scheduled_time=1.0,
                                  first_token_time=2.0, num_cached_tokens=0)
        return [SimpleNamespace(request_id=request_id, finished=True, metrics=metrics,
                                outputs=[SimpleNamespace(token_ids=[7, 7])])]


def _order(num, turns, active, concurrency):
    """(conversation, turn) of each request in the order sent, the most requests in the
    engine at once, and the conversations afterwards."""
    conversations = Conversations(list(range(10, 100)), num, turns, 8, 2, False, seed=0)
    engine = OneAtATime()
    rows = run(engine, conversations, 2, active, concurrency)
    assert len(rows) == num * turns
    return ([(r["conversation"], r["turn"]) for r in rows], 1 + max(engine.in_engine),
            conversations)


def test_one_request_at_a_time_goes_turn_by_turn_across_the_conversations():
    sent, most, _ = _order(num=3, turns=2, active=3, concurrency=1)
    assert sent == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)] and most == 1


def test_a_next_turn_is_queued_when_its_answer_ends_and_new_conversations_wait():
    """Two conversations under way: conversation 2 starts only once 0 has had its turns."""
    sent, most, _ = _order(num=3, turns=2, active=2, concurrency=2)
    assert sent == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)] and most == 2


def test_turns_carry_the_history_or_with_unique_prefixes_nothing():
    _, _, multi = _order(num=2, turns=3, active=2, concurrency=2)
    first = Conversations(list(range(10, 100)), 2, 3, 8, 2, False, seed=0)
    # prefix, then per turn the answer [7, 7] and that turn's message
    assert multi.history[0] == (first.history[0] + [7, 7] + first.messages[0][0] + [7, 7]
                                + first.messages[1][0] + [7, 7] + first.messages[2][0])
    unique = Conversations(list(range(10, 100)), 2, 3, 8, 2, True, seed=0)
    prompts = [unique.prompt(0)]
    while unique.answered(0, [7, 7]):
        prompts.append(unique.prompt(0))
    assert len(prompts) == 3 and prompts[0][:8] == unique.history[0][:8]
    assert all(p[:8] != q[:8] for i, p in enumerate(prompts) for q in prompts[i + 1:])


@pytest.mark.parametrize("direction", ["host_to_device", "device_to_host"])
def test_the_copy_rate_checks_the_bytes_it_moved(tiny_model_folder, monkeypatch, direction):
    import random

    layout = kv_layout(EngineConfig(model=str(tiny_model_folder("llama3")), device="cpu"))
    bench = _Bench(layout, 4)
    row = measure(bench, direction, 4, "scattered", 2, random.Random(0))
    assert row["correct"] and row["bytes"] == 4 * layout.bytes_per_block
    # A copier that drops its batch is caught.
    name = "to_device" if direction == "host_to_device" else "to_host"
    monkeypatch.setattr(type(bench.kv.copier), name, lambda self, *args: None)
    assert not measure(bench, direction, 4, "consecutive", 1, random.Random(1))["correct"]
