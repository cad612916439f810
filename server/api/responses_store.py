"""Stored responses (`store: true`, the default): a bounded in-memory LRU, for `previous_response_id`, GET and
DELETE /v1/responses/{id}.

Each record keeps the whole conversation that led to it (every earlier turn's input and output items, without
instructions, which OpenAI does not carry over), so a chained turn needs one lookup however long the chain is.
The store is only touched from the event loop, so it needs no lock. `--responses-store-size` bounds it by
count; the least recently used record is evicted first, and an evicted id is a 404 like one never stored.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.api.protocol_responses import ResponseObject


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    history: list[dict[str, Any]]  # input items of this turn and of every turn before it, in order
    output: list[dict[str, Any]]  # this turn's output items, as input items of the next turn

    def conversation(self) -> list[dict[str, Any]]:
        """What a turn chained onto this one continues from."""
        return [*self.history, *self.output]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("the responses store size must be non-negative")
        self.capacity = capacity
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def put(self, record: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._records[record.response.id] = record
        self._records.move_to_end(record.response.id)
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        record = self._records.get(response_id)
        if record is not None:
            self._records.move_to_end(response_id)
        return record

    def delete(self, response_id: str) -> bool:
        return self._records.pop(response_id, None) is not None
