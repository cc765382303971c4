"""The responses ``--enable-responses-store`` keeps, in memory, for ``previous_response_id``,
``GET``/``DELETE /v1/responses/{id}`` and its ``input_items``, and for background responses:
vLLM's opt-in store (``VLLM_ENABLE_RESPONSES_API_STORE``), bounded by a count.

Each entry holds the response as it stands (a background one is replaced as it runs) and its
conversation: the input items of every turn that led to it and each turn's output items,
without any turn's ``instructions`` (OpenAI does not carry them over). A request naming it as
``previous_response_id`` runs that conversation with its own input after it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pagedserve.server.protocol import InputItem, ResponseObject
from pagedserve.server.responses_background import EventLog


class StoredResponse(NamedTuple):
    response: ResponseObject
    conversation: list[InputItem]  # the turns' input and output items, this one's last
    input_items: list[dict[str, Any]]  # this request's own input, as input_items lists it
    events: EventLog | None = None  # a background stream's events, for GET ?stream=true


@dataclass
class ResponsesStore:
    """At most ``max_responses`` entries; a new one past the bound drops the oldest created
    (reading one, or replacing it, does not keep it longer)."""

    max_responses: int
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def put(self, entry: StoredResponse) -> list[StoredResponse]:
        """Keep ``entry`` (in place of the one of its id); the entries dropped for it."""
        self._entries[entry.response.id] = entry
        dropped = []
        while len(self._entries) > self.max_responses:
            dropped.append(self._entries.popitem(last=False)[1])
        return dropped

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
