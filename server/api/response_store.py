"""Stored responses of the Responses API: what GET /v1/responses/{id} returns and previous_response_id continues.

Kept in this process's memory, the newest `capacity` of them (least recently used first out). Each holds its whole
conversation as chat messages (without instructions, which OpenAI does not carry over), so a continued response
never depends on an older one still being here. Behind a load balancer a conversation continues on the replica that
stored it, as with vLLM's store.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    """A finished response (as a JSON-ready dict), the conversation up to and including its output, and the input
    items its request gave (OpenAI's item resources, with ids)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]] = field(default_factory=list)


class ResponseStore:
    """The newest `capacity` stored responses by id (0: none are kept)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
