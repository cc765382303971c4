"""``pagedserve bench lora``: its random adapters are PEFT adapters PEFT itself loads, of the
size ``adapter_numel`` says, and a run on a compute-free shape reports every row with the same
output tokens, the slot loads the cycling row needs, and removes its adapters."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch

from pagedserve.bench.random_adapters import adapter_numel, write_random_adapters
from pagedserve.cli import build_parser
from pagedserve.models.loader import load_arch_config, resolve_model


def test_random_adapters_are_the_peft_adapters_peft_loads(llama3_folder, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    arch = load_arch_config(resolve_model(str(llama3_folder)))
    requests = write_random_adapters(tmp_path, arch, 2, 4, torch.float32, torch.device("cpu"))
    assert [r.lora_int_id for r in requests] == [1, 2]
    saved = [load_file(f"{r.lora_path}/adapter_model.safetensors") for r in requests]
    assert sum(t.numel() for t in saved[0].values()) == adapter_numel(arch, 4)
    assert not torch.equal(*(s["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
                             for s in saved))
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama3_folder),
                                      requests[0].lora_path)
    loaded = {name.replace(".default", ""): p for name, p in model.named_parameters()
              if "lora_" in name}
    assert loaded.keys() == saved[0].keys()  # every projection of every layer, nothing more
    assert all(torch.equal(loaded[name], t) for name, t in saved[0].items())


@pytest.mark.parametrize("together", [[], ["--side-by-side"]])
def test_bench_lora_reports_each_workload(tmp_path, monkeypatch, together):
    from pagedserve.bench import lora

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "lora.json"
    args = build_parser().parse_args([
        "bench", "lora", "--shape", "tiny-llama", "--device", "cpu", "--num-prompts", "12",
        "--input-len", "8", "--output-len", "4", "--adapter-counts", "1", "3",
        "--cycle-adapters", "5", "--max-loras", "2", "--max-cpu-loras", "5",
        "--decode-steps", "2", "--rounds", "2", "--out", str(out), *together])
    lora.main(args)
    result = json.loads(out.read_text())
    assert set(result["adapters"]) == {"0", "1", "3"}
    rows = [result["base"]["throughput"], *result["adapters"].values(), result["cycling"]]
    assert all(r["output_tokens"] == 12 * 4 for r in rows)
    assert all(len(r["output_tok_s_per_round"]) == 2 for r in rows[:-1])
    assert result["adapters"]["1"]["slot_loads"] == 0  # its warm-up put it in a slot
    # Five adapters through two slots: at least the three not resident when it starts.
    assert result["cycling"]["slot_loads"] >= 3
    assert result["decode_ms"].keys() == {"no_adapter", "one_adapter", "one_adapter_vs_base"}
    assert not list(tmp_path.glob("pagedserve-lora-*"))
