"""``POST /v1/embeddings``: one engine pooling request per input, on an engine started with
``--runner pooling``.

Each input (a text, token ids, or a list of either) becomes its prompt's pooled final hidden
state (``--pooler-config``); ``data[i]`` is input ``i``'s. ``encoding_format: base64`` sends
each vector as OpenAI does: the base64 of its little-endian float32 bytes. ``dimensions`` keeps
each vector's first values, normalized after the cut, on a Matryoshka model only (vLLM's rule:
``is_matryoshka`` or ``matryoshka_dimensions`` in its config.json). ``priority`` is a
completion's (``--scheduling-policy priority``).

``pool`` is the path every pooling endpoint takes (scoring and reranking too): a request's
fields of inputs, each checked under its own name, all sent to the engine as one batch.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pagedserve.pooling_params import PoolingParams
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PromptInput,
)
from pagedserve.server.request_ids import RequestIds
from pagedserve.server.serving_completion import tokenized_prompts
from pagedserve.server.serving_models import (
    CONTEXT_LENGTH_EXCEEDED,
    ServedModel,
    ServingModels,
    finals,
)


class Pooled(NamedTuple):
    """What ``pool`` computed: the model's name as the API calls it and, for each field of
    inputs, its prompts' token ids as they ran (truncated) and their embeddings."""

    model: str
    token_lists: list[list[list[int]]]
    embeddings: list[list[list[float]]]

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for field in self.token_lists for tokens in field)


async def pool(models: ServingModels, model_name: str | None,
               fields: Sequence[tuple[PromptInput, str]], params: PoolingParams,
               ids: RequestIds, field_name: Callable[[str], str], priority: int = 0) -> Pooled:
    """Embed every prompt of ``fields`` (input, the request's name for it) in one engine
    batch, at ``priority``: if one is refused, none runs. A prompt that is empty or longer
    than the context is refused here, naming its field; the engine's other refusals are named
    by ``field_name``."""
    arrival = time.perf_counter()
    route = models.resolve(model_name)
    model = route.model
    token_lists = [await model.off_loop(_prompts_as_run, model, prompt, param, params)
                   for prompt, param in fields]
    streams = await model.client.submit_all(
        ids.engine, [tokens for field in token_lists for tokens in field], params, arrival,
        field_name, route.lora, priority)
    outputs = iter(await finals(streams))
    embeddings = [[next(outputs).embedding for _ in field] for field in token_lists]
    return Pooled(route.name, token_lists, embeddings)


def _prompts_as_run(model: ServedModel, prompt: PromptInput, param: str,
                    params: PoolingParams) -> list[list[int]]:
    token_lists = [model.truncate(p.token_ids, params)
                   for p in tokenized_prompts(model, prompt, param)]
    for tokens in token_lists:
        if not tokens:
            raise bad_request(f"{param}: a prompt is empty", param=param)
        if len(tokens) > model.max_model_len:
            raise bad_request(
                f"{param}: a prompt has {len(tokens)} tokens but the model's context length "
                f"is {model.max_model_len}; shorten it or set truncate_prompt_tokens",
                param=param, code=CONTEXT_LENGTH_EXCEEDED)
    return token_lists


@dataclass
class EmbeddingServing:
    models: ServingModels

    async def create(self, request: EmbeddingRequest, ids: RequestIds) -> EmbeddingResponse:
        pooled = await pool(self.models, request.model, [(request.input, "input")],
                            request.to_pooling_params(), ids, request.field_name,
                            request.priority)
        data = [EmbeddingData(index=i, embedding=_encoded(e, request.encoding_format))
                for i, e in enumerate(pooled.embeddings[0])]
        return EmbeddingResponse(data=data, model=pooled.model,
                                 usage=EmbeddingUsage(prompt_tokens=pooled.num_tokens,
                                                      total_tokens=pooled.num_tokens))


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
