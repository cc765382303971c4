"""The engine's view of adapters: each request's adapter read once (on the engine's side, before
any rank needs it), checked against ``--max-lora-rank``, and its content hash, which keys the
prefix cache, remembered by ``lora_int_id``."""

from __future__ import annotations

from pagedserve.lora.adapter import load_adapter
from pagedserve.lora.request import LoRARequest


class AdapterKeys:
    def __init__(self, max_rank: int) -> None:
        self.max_rank = max_rank
        self._keys: dict[LoRARequest, str] = {}

    def key(self, request: LoRARequest) -> str:
        """The adapter's content hash; ``ValueError`` (one line) for an adapter the engine
        cannot serve."""
        if request not in self._keys:
            adapter = load_adapter(request.lora_path)
            if adapter.max_rank > self.max_rank:
                raise ValueError(f"LoRA adapter {request.lora_name}: rank {adapter.max_rank} "
                                 f"is above --max-lora-rank {self.max_rank}")
            self._keys[request] = adapter.content_hash
        return self._keys[request]
