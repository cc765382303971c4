"""Which adapter a request runs with: plain data, read by the engine, the scheduler and every
rank (no torch here, so the core may hold it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's: ``lora_name`` for people, ``lora_int_id`` (at least 1) the adapter's identity in
    the engine, ``lora_path`` a PEFT folder or Hugging Face id."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be at least 1, "
                             f"got {self.lora_int_id}")
