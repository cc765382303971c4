"""pagedserve: an LLM serving engine with PagedAttention and continuous batching.

``from pagedserve import LLM, SamplingParams`` mirrors vLLM's offline API. Heavy modules load
on first use so ``import pagedserve`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.lora.request import LoRARequest
    from pagedserve.outputs import (
        BeamSearchOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from pagedserve.pooling_params import PoolingParams
    from pagedserve.sampling_params import (
        BeamSearchParams,
        SamplingParams,
        StructuredOutputsParams,
    )

_LAZY = {
    "LLM": "pagedserve.entrypoints.llm",
    "SamplingParams": "pagedserve.sampling_params",
    "StructuredOutputsParams": "pagedserve.sampling_params",
    "BeamSearchParams": "pagedserve.sampling_params",
    "BeamSearchOutput": "pagedserve.outputs",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "EmbeddingRequestOutput": "pagedserve.outputs",
    "ClassificationRequestOutput": "pagedserve.outputs",
    "ScoringRequestOutput": "pagedserve.outputs",
    "PoolingParams": "pagedserve.pooling_params",
    "EngineConfig": "pagedserve.config",
    "LoRARequest": "pagedserve.lora.request",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams",
           "RequestOutput", "CompletionOutput", "BeamSearchOutput", "EngineConfig",
           "LoRARequest", "PoolingParams", "EmbeddingRequestOutput",
           "ClassificationRequestOutput", "ScoringRequestOutput", "__version__"]
