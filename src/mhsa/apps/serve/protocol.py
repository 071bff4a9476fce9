"""uvicorn's h11 protocol with a header read timeout: a connection must deliver a whole
request head (request line and headers) within header_seconds of opening, or of its
previous response ending; otherwise it gets a 408 and is closed. uvicorn itself waits
for ever on a client that opens connections and sends a few header bytes now and then
(slowloris), each holding a socket and a slot of the server."""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 33\r\n\r\nthe request head came too slowly\n"
)


def header_timeout_protocol(header_seconds: float) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config(http=...)) that closes a connection whose
    request head has not fully arrived header_seconds after it opened or after its last
    response (0: no limit)."""

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is in: its body is timed
                self._disarm()  # by the app (body_seconds)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's head (keep-alive) is timed afresh

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if header_seconds > 0:
                self._head_timer = self.loop.call_later(header_seconds, self._too_slow)

        def _disarm(self) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.our_state is h11.IDLE:  # (no response under way)
                self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()

    return HeaderTimeoutProtocol
