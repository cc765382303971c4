"""LoRA adapters: reading PEFT folders, device slots, the wrapped linear layer and the
portable batched matmuls (docs/lora.md)."""
