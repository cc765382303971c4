"""What a step hands the engine is host data: ``StepResult`` and ``StepOutput`` hold no
tensor, under async scheduling (where the next step reads the previous one's tokens on the
device, inside the runner) and with prompt logprobs and sampled logprobs, so the engine could
live in another process than rank 0 without touching a device."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import pagedserve
from pagedserve import SamplingParams
from tests.tiny_models import make_llm, random_prompts


def _tensors_in(value, path: str = "") -> list[str]:
    """The paths of every tensor inside ``value`` (tuples, lists, dicts, dataclass fields)."""
    if isinstance(value, torch.Tensor):
        return [path or "<root>"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _tensors_in(v, f"{path}[{k!r}]")]
    if isinstance(value, list | tuple):
        fields = getattr(value, "_fields", None) or range(len(value))
        return [p for name, v in zip(fields, value, strict=True)
                for p in _tensors_in(v, f"{path}.{name}")]
    return []


def test_the_walker_finds_a_tensor_nested_in_a_named_tuple():
    from pagedserve.worker.step import StepOutput

    assert _tensors_in(StepOutput(None, {"s": (1, [torch.zeros(1)])})) == [
        ".prompt_logprobs['s'].1.0"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_crosses_to_the_engine_as_host_data_only(llama3_folder, async_scheduling):
    llm = make_llm(llama3_folder, async_scheduling=async_scheduling)
    engine, seen = llm.engine, []
    for name in ("execute", "forward", "sample", "fetch"):
        call = getattr(engine.executor, name)

        def recorded(*args, _call=call, _name=name):
            result = _call(*args)
            seen.append((_name, result))
            return result

        setattr(engine.executor, name, recorded)
    prompts = random_prompts(3, [12, 20, 7])
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.8, seed=1, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=6, prompt_logprobs=1, ignore_eos=True)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert outputs[2].prompt_logprobs is not None and outputs[1].outputs[0].logprobs
    assert {name for name, _ in seen} >= {"execute", "fetch"}
    assert [(name, found) for name, result in seen if (found := _tensors_in(result))] == []


def test_the_engine_never_imports_torch():
    """The engine reads and writes plain data only; torch stays below the executor."""
    engine = Path(pagedserve.__file__).parent / "engine"
    offending = {}
    for path in engine.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "torch" or n.startswith("torch.") for n in names):
                offending.setdefault(path.name, []).extend(names)
    assert offending == {}
