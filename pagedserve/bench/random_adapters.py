"""Random LoRA adapters of a model's shape, written as PEFT folders, for benchmarks.

Each folder holds PEFT's ``adapter_config.json`` and ``adapter_model.safetensors`` with A and B
of rank ``rank`` on all seven projections (q/k/v/o, gate/up/down) of every layer, so the
engine reads it as any PEFT adapter. Llama-3-8B's shape at rank 16 is 41.9 M numbers per
adapter, 84 MB in bf16 (per layer: A 6 x 16 x 4096 + 16 x 14336, B 16 x (2 x 4096 + 2 x 1024
+ 2 x 14336 + 4096)): the numbers are drawn on the engine's device, where they take
milliseconds, and only copied to the host to be written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagedserve.lora.adapter import CONFIG_FILE, PROJECTIONS, parent_module
from pagedserve.lora.host_adapters import shard_shapes
from pagedserve.lora.request import LoRARequest
from pagedserve.models.config import ModelArchConfig


def adapter_numel(arch: ModelArchConfig, rank: int) -> int:
    """Numbers in one adapter of ``rank`` on all seven projections."""
    shapes = shard_shapes(arch)
    return arch.num_layers * rank * sum(out + inp for out, inp in
                                        (shapes[key] for key in PROJECTIONS.values()))


def write_random_adapters(folder: Path, arch: ModelArchConfig, count: int, rank: int,
                          dtype: torch.dtype, device: torch.device, seed: int = 0
                          ) -> list[LoRARequest]:
    """``count`` adapters under ``folder`` (``adapter-0`` ...), each with its own random weights
    (so content hashes differ); the requests' ``lora_int_id`` run from 1."""
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
              "target_modules": list(PROJECTIONS)}
    gen = torch.Generator(device=device).manual_seed(seed)
    requests = []
    for i in range(count):
        path = folder / f"adapter-{i}"
        path.mkdir(parents=True)
        _write_weights(path, arch, rank, dtype, device, gen)
        (path / CONFIG_FILE).write_text(json.dumps(config))
        requests.append(LoRARequest(f"adapter-{i}", i + 1, str(path)))
    return requests


def _write_weights(path: Path, arch: ModelArchConfig, rank: int, dtype: torch.dtype,
                   device: torch.device, gen: torch.Generator) -> None:
    from safetensors.torch import save_file

    shapes = shard_shapes(arch)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, key in PROJECTIONS.items():
            out, inp = shapes[key]
            prefix = f"base_model.model.model.layers.{layer}.{parent_module(module)}.{module}"
            # A as PEFT's Kaiming-uniform-like init; B small, so random bases stay finite.
            tensors[f"{prefix}.lora_A.weight"] = _normal((rank, inp), inp ** -0.5, dtype,
                                                         device, gen)
            tensors[f"{prefix}.lora_B.weight"] = _normal((out, rank), 0.02, dtype, device, gen)
    save_file(tensors, path / "adapter_model.safetensors")


def _normal(shape: tuple[int, int], std: float, dtype: torch.dtype, device: torch.device,
            gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=device) * std).to(dtype).cpu()
