"""vLLM's scoring endpoints for an embedding model (an engine started with ``--runner
pooling``): ``POST /v1/score`` (``/score``) scores ``text_1`` against ``text_2``, 1:N or N:N;
``POST /v1/rerank`` (``/rerank``, ``/v2/rerank``: Jina's and Cohere's form) orders
``documents`` by their score against ``query``, best first.

A score is the cosine similarity of the two texts' embeddings (``pagedserve.scoring``), each
text embedded once, all of a request's in one engine batch (``serving_embedding.pool``). With a
cross-encoder (a sequence classifier of one label) it is the probability the classifier gives
the pair joined as one prompt by the tokenizer's pair encoding, as vLLM's. The pairing is
checked before anything runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedserve.scoring import cosine_similarity, cross_encoder_prompts, score_pairs
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import (
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedserve.server.request_ids import RequestIds
from pagedserve.server.serving_embedding import Pooled, pool
from pagedserve.server.serving_models import ServingModels


@dataclass
class ScoreServing:
    models: ServingModels

    async def score(self, request: ScoreRequest, ids: RequestIds) -> ScoreResponse:
        pooled, scores = await self._scored(request, (request.text_1, "text_1"),
                                            (request.text_2, "text_2"), ids)
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        return ScoreResponse(id=ids.response, model=pooled.model, data=data,
                             usage=EmbeddingUsage(prompt_tokens=pooled.num_tokens,
                                                  total_tokens=pooled.num_tokens))

    async def rerank(self, request: RerankRequest, ids: RequestIds) -> RerankResponse:
        pooled, scores = await self._scored(request, (request.query, "query"),
                                            (request.documents, "documents"), ids)
        # Best first; equal scores keep the documents' order (the sort is stable).
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:request.top_n or None]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=request.documents[i])
                                if request.return_documents else None)
                   for i in order]
        return RerankResponse(id=ids.response, model=pooled.model, results=results,
                              usage=RerankUsage(total_tokens=pooled.num_tokens))


    async def _scored(self, request: ScoreRequest | RerankRequest,
                      first: tuple[str | list[str], str], second: tuple[str | list[str], str],
                      ids: RequestIds) -> tuple[Pooled, list[float]]:
        """Each pair's score: the embeddings' cosine, or a cross-encoder's probability."""
        pairs = _pairs(first[0], second[0], second[1])
        model = self.models.resolve(request.model).model
        params = request.to_pooling_params()
        if len(model.labels) != 1:
            pooled = await pool(self.models, request.model, [first, second], params, ids,
                                request.field_name, request.priority)
            return pooled, _scores(pooled, pairs)
        prompts = await model.off_loop(cross_encoder_prompts, model.tokenizer,
                                       _texts(first[0]), _texts(second[0]), pairs)
        pooled = await pool(self.models, request.model, [(prompts, second[1])],
                            dataclasses.replace(params, task="classify"), ids,
                            request.field_name, request.priority)
        return pooled, [probs[0] for probs in pooled.embeddings[0]]


def _texts(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else texts


def _pairs(first: str | list[str], second: str | list[str], param: str
           ) -> list[tuple[int, int]]:
    try:
        return score_pairs(_count(first), _count(second))
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None


def _count(texts: str | list[str]) -> int:
    return len(_texts(texts))


def _scores(pooled: Pooled, pairs: list[tuple[int, int]]) -> list[float]:
    firsts, seconds = pooled.embeddings
    return [cosine_similarity(firsts[i], seconds[j]) for i, j in pairs]
