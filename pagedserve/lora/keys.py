"""The engine's view of adapters: each request's adapter read once (on the engine's side, before
any rank needs it), checked against ``--max-lora-rank`` and the model's shapes, and its content
hash, which keys the prefix cache, remembered per request."""

from __future__ import annotations

from pagedserve.lora.adapter import ShardShapes, check_fits, load_adapter
from pagedserve.lora.request import LoRARequest
from pagedserve.models.config import ModelArchConfig


def shard_shapes(arch: ModelArchConfig) -> ShardShapes:
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {("qkv_proj", 0): (q, hidden), ("qkv_proj", 1): (kv, hidden),
            ("qkv_proj", 2): (kv, hidden), ("o_proj", 0): (hidden, q),
            ("gate_up_proj", 0): (inter, hidden), ("gate_up_proj", 1): (inter, hidden),
            ("down_proj", 0): (hidden, inter)}


class AdapterKeys:
    def __init__(self, max_rank: int, arch: ModelArchConfig) -> None:
        self.max_rank = max_rank
        self.num_layers = arch.num_layers
        self.shapes = shard_shapes(arch)
        self._keys: dict[LoRARequest, str] = {}

    def key(self, request: LoRARequest) -> str:
        """The adapter's content hash; ``ValueError`` (one line) for an adapter the engine
        cannot serve."""
        if request not in self._keys:
            # The ranks keep loaded adapters by id: another folder under a known id would run
            # the adapter they hold.
            held = next((r for r in self._keys if r.lora_int_id == request.lora_int_id
                         and r.lora_path != request.lora_path), None)
            if held is not None:
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is in use by adapter "
                    f"{held.lora_name!r} ({held.lora_path}); give {request.lora_name!r} "
                    "another id, or remove the first (engine.remove_lora) before reusing it")
            adapter = load_adapter(request.lora_path)
            check_fits(request.lora_name, adapter, self.max_rank, self.num_layers, self.shapes)
            self._keys[request] = adapter.content_hash
        return self._keys[request]

    def forget(self, lora_int_id: int) -> None:
        """Drop what is remembered of the adapter of this id (it is read again if it returns,
        so an id reused for another folder never takes the old one's key)."""
        self._keys = {r: key for r, key in self._keys.items() if r.lora_int_id != lora_int_id}
