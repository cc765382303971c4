"""``POST /v1/embeddings``: one engine pooling request per input, on an engine started with
``--runner pooling``.

Each input (a text, token ids, or a list of either) becomes its prompt's pooled final hidden
state (``--pooler-config``); ``data[i]`` is input ``i``'s. ``encoding_format: base64`` sends
each vector as OpenAI does: the base64 of its little-endian float32 bytes. ``dimensions`` keeps
each vector's first values, normalized after the cut, on a Matryoshka model only (vLLM's rule:
``is_matryoshka`` or ``matryoshka_dimensions`` in its config.json). ``priority`` is a
completion's (``--scheduling-policy priority``).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass

import numpy as np

from pagedserve.server.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagedserve.server.request_ids import RequestIds
from pagedserve.server.serving_completion import tokenized_prompts
from pagedserve.server.serving_models import ServingModels, finals


@dataclass
class EmbeddingServing:
    models: ServingModels

    async def create(self, request: EmbeddingRequest, ids: RequestIds) -> EmbeddingResponse:
        arrival = time.perf_counter()
        route = self.models.resolve(request.model)
        model = route.model
        params = request.to_pooling_params()
        prompts = await model.off_loop(tokenized_prompts, model, request.input, "input")
        token_lists = [model.truncate(p.token_ids, params) for p in prompts]
        streams = await model.client.submit_all(ids.engine, token_lists, params, arrival,
                                                request.field_name, route.lora,
                                                request.priority)
        outputs = await finals(streams)
        data = [EmbeddingData(index=i, embedding=_encoded(o.embedding, request.encoding_format))
                for i, o in enumerate(outputs)]
        num_tokens = sum(map(len, token_lists))
        return EmbeddingResponse(data=data, model=route.name,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens,
                                                      total_tokens=num_tokens))


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
