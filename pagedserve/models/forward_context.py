"""What one forward pass reads besides its token ids and positions: the step's per-step state.

The runner builds one ``ForwardContext`` per step (``worker/input_batch.py``) and the model
passes it down as an argument, through every decoder layer to the modules that own the
projections (``LlamaAttention``, ``LlamaMLP``) and to the attention backend (which reads
``attn``). Nothing lives in a global or thread-local context, so a layer's inputs are its
arguments and two models (a draft and a target) can run in one process.

Per-row extras are the per-token state a layer may read besides the attention metadata. Each
is indexed by token row (like ``input_ids``) and None where the step has none, which costs the
layers nothing. Where a new extra is read:

- inside a layer, by the module that owns the projections, which hands it to the projection
  it concerns. The LoRA layers will wrap a ``Linear`` (base output plus ``B[slot] @ A[slot] @
  x`` per row) and be called as ``self.qkv_proj(hidden, ctx.lora_slots)``; a quant method's
  ``apply(layer, x)`` stays as it is, since the adapter's delta is added outside it.
- under graph capture, from a static buffer that replay fills as it fills the metadata's; a
  graph runner with no buffer for an extra refuses (``can_run``) a step that carries it, so
  the step runs eagerly rather than without it.

Draft tokens of speculative decoding need no extra here: a verify step is a chunk of k + 1
tokens per sequence, which the attention metadata already describes, and the positions sampled
are the sampler's (``ModelInputs.logits_indices``), not a layer's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn: AttentionMetadata
    # Per token row: the adapter slot, -1 for none (int32 [num_tokens]); filled by the model
    # runner from the step's adapters (lora/slots.py). None: no adapters in this step.
    lora_slots: torch.Tensor | None = None
    # Per token row: its sequence rotates by longrope's long factors at every position
    # (``Sequence.long_rope``; bool [num_tokens]). None: no such sequence in this step.
    long_rope: torch.Tensor | None = None

    @property
    def has_row_extras(self) -> bool:
        """Whether the step carries any per-row extra (CUDA graphs hold buffers for both;
        a graph runner that holds none runs such a step eagerly)."""
        return self.lora_slots is not None or self.long_rope is not None
