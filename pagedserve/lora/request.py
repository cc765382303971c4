"""Which adapter a request runs with: plain data, read by the engine, the scheduler and every
rank (no torch here, so the core may hold it)."""

from __future__ import annotations

import os
from dataclasses import dataclass

# The largest id: the messages to the engine core carry ids as 64-bit integers (msgspec), so a
# larger one failed every request on its adapter with an OverflowError.
MAX_LORA_INT_ID = 2**63 - 1


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's: ``lora_name`` for people, ``lora_int_id`` (at least 1) the adapter's identity in
    the engine, ``lora_path`` a PEFT folder or Hugging Face id."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        # A string id failed the comparison below with a TypeError naming nothing; a float
        # or True passed as an id.
        for name, ok, kind in (
                ("lora_name", isinstance(self.lora_name, str), "a string"),
                ("lora_int_id", isinstance(self.lora_int_id, int)
                 and not isinstance(self.lora_int_id, bool), "an integer"),
                ("lora_path", isinstance(self.lora_path, (str, os.PathLike)), "a string")):
            if not ok:
                raise TypeError(f"LoRARequest: {name} must be {kind}, got "
                                f"{getattr(self, name)!r:.80}")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be at least 1, "
                             f"got {self.lora_int_id}")
        if self.lora_int_id > MAX_LORA_INT_ID:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be at most "
                             f"2**63 - 1, got {self.lora_int_id}")
