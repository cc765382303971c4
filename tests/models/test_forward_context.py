"""The forward context reaches every layer as an argument: the object the runner built for the
step, with its per-row extras, arrives at each decoder layer, at the modules that own the
projections and at the attention backend; and the model's outputs with it equal transformers'.
"""

from __future__ import annotations

import torch

from pagedserve import SamplingParams
from pagedserve.models.forward_context import ForwardContext
from pagedserve.worker.input_batch import HostInputs
from tests.tiny_models import hf_greedy, hf_model, make_llm, random_prompts

NEW_TOKENS = 6


def _mark_every_step(monkeypatch) -> list[ForwardContext]:
    """Give every context the runner builds adapter slots (one per token row) and keep it."""
    built = []
    to_device = HostInputs.to_device

    def with_slots(self, *args, **kwargs):
        inputs = to_device(self, *args, **kwargs)
        rows = inputs.input_ids.shape[0]
        inputs.ctx.lora_slots = torch.arange(rows, dtype=torch.int32) % 3 - 1
        built.append(inputs.ctx)
        return inputs

    monkeypatch.setattr(HostInputs, "to_device", with_slots)
    return built


def _record_contexts(model: torch.nn.Module) -> dict[str, list]:
    """The last positional argument of every call of the modules that take the context."""
    seen: dict[str, list] = {}
    for name, module in model.named_modules():
        if name.endswith(("layers.0", "layers.1", "self_attn", "mlp", "attn")):
            calls = seen.setdefault(name, [])
            module.register_forward_pre_hook(lambda m, args, calls=calls: calls.append(args[-1]))
    return seen


def test_the_runners_context_and_its_extras_reach_every_layer(llama3_folder, monkeypatch):
    built = _mark_every_step(monkeypatch)
    llm = make_llm(llama3_folder)
    seen = _record_contexts(llm.engine.executor.runner.model)
    prompt = random_prompts("ctx", [20])[0]
    llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                          ignore_eos=True))
    assert len(built) == NEW_TOKENS  # one prefill step, then one per further token
    # Two layers, each with its attention, its MLP and the paged attention inside.
    assert len(seen) == 2 * 4 and all("layers." in name for name in seen)
    for name, calls in seen.items():
        assert len(calls) == len(built), name
        for got, ctx in zip(calls, built):
            assert got is ctx, name
            assert got.lora_slots.tolist() == (torch.arange(got.attn.num_tokens) % 3 - 1).tolist()


def test_outputs_with_the_context_equal_transformers(llama3_folder, monkeypatch):
    """Logits of the prompt step and the greedy continuation, both with extras set on every
    step's context, against transformers."""
    _mark_every_step(monkeypatch)
    llm = make_llm(llama3_folder)
    runner = llm.engine.executor.runner
    hidden = []
    runner.model.register_forward_hook(lambda m, args, out: hidden.append(out))
    prompt = random_prompts("ctx-hf", [23])[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                ignore_eos=True))
    reference = hf_model(llama3_folder)
    assert out[0].outputs[0].token_ids == hf_greedy(reference, prompt, NEW_TOKENS)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
        got = runner.model.compute_logits(hidden[0])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
