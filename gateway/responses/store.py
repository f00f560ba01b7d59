"""Stored responses (store=true), for `previous_response_id` and GET /v1/responses/{id}: kept
in api.py's memory, least recently used first out once RESPONSE_STORE_BYTES is passed. A
restart of api.py forgets them (the ranks' prefix cache still holds the conversations' KV,
so a client that resends the whole history loses nothing but the id)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gateway.responses.protocol import Response
from ipc.protocol import ChatMessage

DEFAULT_STORE_BYTES = 128 * 2**20


@dataclass
class Stored:
    response: Response
    conversation: list[ChatMessage]  # its input and output, without its instructions
    nbytes: int


class ResponseStore:
    def __init__(self, limit_bytes: int | None = None) -> None:
        self.limit_bytes = DEFAULT_STORE_BYTES if limit_bytes is None else limit_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Stored | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def put(self, response: Response, conversation: list[ChatMessage]) -> None:
        size = len(response.model_dump_json()) + sum(
            len(message.model_dump_json()) for message in conversation
        )
        if size > self.limit_bytes:
            return  # larger than the whole store: kept nowhere
        self.delete(response.id)
        self._entries[response.id] = Stored(response, conversation, size)
        self.nbytes += size
        while self.nbytes > self.limit_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.nbytes -= oldest.nbytes

    def delete(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is not None:
            self.nbytes -= stored.nbytes
        return stored is not None
