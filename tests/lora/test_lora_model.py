"""Our model with LoRA layers on a mixed batch (base rows and rows of three adapters of
different ranks, alphas and target sets, rsLoRA and rank/alpha patterns among them) against
PEFT's forward of each adapter, for the Llama, Qwen2 and Qwen3 shapes (float32)."""

from __future__ import annotations

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.errors import ConfigError
from pagedserve.lora.adapter import load_adapter
from pagedserve.lora.layers import LoRALinear
from pagedserve.lora.ops import LoRAOps
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.slots import add_lora_layers
from pagedserve.platforms.cpu.lora_ops import GroupedLoRAOps
from pagedserve.worker.input_batch import HostInputs
from tests.lora.peft_adapters import ADAPTER_SPECS, base_model, peft_model, write_adapter
from tests.tiny_models import make_llm, random_prompts

ADAPTERS = ["attn", "mlp_rslora", "mixed"]


def _slots_on_prefill(monkeypatch, row_slots: list[int]) -> None:
    """Give the first step's context these per-sequence slots on every row of each sequence."""
    to_device = HostInputs.to_device

    def with_slots(self, *args, **kwargs):
        inputs = to_device(self, *args, **kwargs)
        per_row = torch.repeat_interleave(torch.tensor(row_slots, dtype=torch.int32),
                                          torch.tensor(self.query_lens))
        inputs.ctx.lora_slots = per_row
        return inputs

    monkeypatch.setattr(HostInputs, "to_device", with_slots)


@pytest.mark.parametrize("ops", [GroupedLoRAOps, LoRAOps])  # the CPU's; Gaudi's masked one
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "phi3", "granite"])
def test_mixed_batch_equals_peft_per_adapter(tiny_model_folder, tmp_path, monkeypatch, arch,
                                             ops):
    base = tiny_model_folder(arch)
    folders = {n: write_adapter(base, tmp_path / n, ADAPTER_SPECS[n], seed=i)
               for i, n in enumerate(ADAPTERS)}
    llm = make_llm(base)
    runner = llm.engine.executor.runner
    slots = add_lora_layers(runner.model, ops, max_loras=4, max_rank=8, free_bytes=1 << 30)
    requests = [LoRARequest(n, i + 1, str(folders[n])) for i, n in enumerate(ADAPTERS)]
    for request in requests:
        slots.add(request.lora_int_id, load_adapter(request.lora_path))
    slot_of = slots.slots_for(requests[::-1])  # slots in another order than the requests
    # Rows: base, then each adapter, then the first adapter again after a base row.
    order = [None, *requests, None, requests[0]]
    _slots_on_prefill(monkeypatch, [-1 if r is None else slot_of[r.lora_int_id] for r in order])
    prompts = random_prompts(f"lora-{arch}", [9, 12, 7, 10, 5, 8])
    hidden = []
    runner.model.register_forward_hook(lambda m, args, out: hidden.append(out))
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    logits = runner.model.compute_logits(hidden[0])
    start = 0
    for prompt, request in zip(prompts, order):
        ref = base_model(base) if request is None else peft_model(base, folders[request.lora_name])
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        got = logits[start:start + len(prompt)]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        if request is not None:  # the adapter changed the output
            assert (expected - base_model(base)(torch.tensor([prompt])).logits[0]).abs().max() > 0.1
        start += len(prompt)


def test_slots_past_free_memory_are_refused_before_allocating(tiny_model_folder):
    """The slots' bytes are counted before any is allocated: with exactly the bytes the
    wrapped layers then hold free, they fit; with a byte less, nothing is wrapped."""
    folder = tiny_model_folder("llama3")
    model = make_llm(folder).engine.executor.runner.model
    slots = add_lora_layers(model, LoRAOps, max_loras=3, max_rank=5, free_bytes=1 << 40)
    held = sum(b.numel() * b.element_size() for layer in slots.layers.values()
               for b in (layer.lora_a, layer.lora_b))
    fresh = make_llm(folder).engine.executor.runner.model
    with pytest.raises(ConfigError, match="--max-loras 3 slots of --max-lora-rank 5"):
        add_lora_layers(fresh, LoRAOps, max_loras=3, max_rank=5, free_bytes=held - 1)
    assert not any(isinstance(m, LoRALinear) for m in fresh.modules())
    add_lora_layers(fresh, LoRAOps, max_loras=3, max_rank=5, free_bytes=held)
