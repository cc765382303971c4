"""vLLM's ``POST /classify`` (``/v1/classify``): each input's label probabilities from a
sequence classifier (``XForSequenceClassification``, served with ``--runner pooling``).

The inputs run as one batch of pooling requests of task "classify" (``serving_embedding.pool``,
the path every pooling endpoint takes); the engine refuses them on a model that is no
classifier. ``data[i]`` is input ``i``'s probabilities and its most probable label, named by
the model's ``id2label``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.server.protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    ClassificationUsage,
)
from pagedserve.server.request_ids import RequestIds
from pagedserve.server.serving_embedding import pool
from pagedserve.server.serving_models import ServingModels


@dataclass
class ClassificationServing:
    models: ServingModels

    async def create(self, request: ClassificationRequest, ids: RequestIds
                     ) -> ClassificationResponse:
        labels = self.models.resolve(request.model).model.labels
        pooled = await pool(self.models, request.model, [(request.input, "input")],
                            request.to_pooling_params(), ids, request.field_name,
                            request.priority)
        data = [_classified(i, probs, labels) for i, probs in enumerate(pooled.embeddings[0])]
        return ClassificationResponse(
            id=ids.response, model=pooled.model, data=data,
            usage=ClassificationUsage(prompt_tokens=pooled.num_tokens,
                                      total_tokens=pooled.num_tokens))


def _classified(index: int, probs: list[float], labels: tuple[str, ...]) -> ClassificationData:
    best = max(range(len(probs)), key=probs.__getitem__)
    label = labels[best] if best < len(labels) else f"LABEL_{best}"
    return ClassificationData(index=index, label=label, probs=probs, num_classes=len(probs))
