"""``bench decode``'s step timing against an engine whose steps take known times."""

from __future__ import annotations

from types import SimpleNamespace

from pagedserve.bench import decode


class _ScriptedEngine:
    """A prompt step of 1.0 s whose device time the first decode step waits for (as under
    async scheduling: the host returns from the prompt step at once), then decode steps of
    0.01 s. The clock is the script's, advanced by each step."""

    def __init__(self, clock: list[float], batch: int, decode_steps: int) -> None:
        self.clock, self.batch = clock, batch
        self.steps = [("prompt", 0.001), ("decode", 1.0 + 0.01)]
        self.steps += [("decode", 0.01)] * (decode_steps - 1)
        self.prompt_tokens = self.generation_tokens = 0

    def add_request(self, prompt, params) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self.steps)

    def step(self) -> None:
        kind, seconds = self.steps.pop(0)
        self.clock[0] += seconds
        if kind == "prompt":
            self.prompt_tokens += 1
        else:
            self.generation_tokens += self.batch

    def stats(self):
        return SimpleNamespace(prompt_tokens=self.prompt_tokens,
                               generation_tokens=self.generation_tokens, num_preemptions=0)


def test_wall_time_leaves_out_the_wait_for_the_prompt_step(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(decode.time, "perf_counter", lambda: clock[0])
    timed = decode.time_decode(_ScriptedEngine(clock, batch=4, decode_steps=9), 4, 3, 7)
    assert abs(timed.median_s - 0.01) < 1e-9
    # From the start of the first decode step it would read (1.01 + 8 * 0.01) / 9 = 0.121.
    assert abs(timed.wall_s - 0.01) < 1e-9
