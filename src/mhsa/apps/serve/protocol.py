"""uvicorn's h11 protocol with the time limits uvicorn lacks, so that no client holds a
connection (a socket and a slot of the server) for ever:

- the request head (request line and headers) must arrive within header_seconds of the
  connection opening or of its previous response ending, else a 408 and the connection
  is closed (uvicorn waits for ever on a client that sends a header byte now and then:
  slowloris);
- a request body must arrive whole within body_seconds of its head, in total however
  steadily its bytes come (uvicorn's keep-alive timer restarts on every byte), else a
  408 (when nothing was answered yet) and the connection is closed;
- a response sent before its request's body came whole (an early error: 413, 401...)
  ends the connection: nobody will read the rest of that body, and h11 cannot begin the
  next request before it.

The app gives its own, friendlier 408 when it reads a body too slowly (mhsa serve
--body-seconds); the server passes this protocol a body_seconds a little longer, so this
one only ends what the app does not."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _timeout_response(what: str) -> bytes:
    text = f"the request {what} came too slowly\n".encode()
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text)
    )


HEAD_TIMEOUT = _timeout_response("head")
BODY_TIMEOUT = _timeout_response("body")


def timeout_protocol(header_seconds: float, body_seconds: float = 0.0) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config(http=...)) that closes a connection whose
    request head has not fully arrived header_seconds after it opened or after its last
    response, or whose request body has not fully arrived body_seconds after its head
    (0: no limit, for either); and one whose response went out before its body came."""
    for name, value in (("header_seconds", header_seconds), ("body_seconds", body_seconds)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")

    class TimeoutProtocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._arm_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is in
                self._cancel("_head_timer")
            self._watch_body()

        def on_response_complete(self) -> None:
            if self.conn.their_state is h11.SEND_BODY:  # answered before the body came
                self._close()
            super().on_response_complete()  # (it counts the request; closing: no more)
            if self.transport.is_closing():
                return
            self._arm_head()  # the next request's head (keep-alive) is timed afresh
            self._watch_body()  # (or its body: a pipelined head may be in already)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel("_head_timer")
            self._cancel("_body_timer")
            super().connection_lost(exc)

        def _arm_head(self) -> None:
            self._cancel("_head_timer")
            if header_seconds > 0 and not self.transport.is_closing():
                self._head_timer = self.loop.call_later(header_seconds, self._head_too_slow)

        def _watch_body(self) -> None:
            """Time the body from its head's arrival; stop once it is whole."""
            if self.conn.their_state is not h11.SEND_BODY:
                self._cancel("_body_timer")
            elif self._body_timer is None and body_seconds > 0:
                self._body_timer = self.loop.call_later(body_seconds, self._body_too_slow)

        def _cancel(self, name: str) -> None:
            timer = getattr(self, name, None)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            self._close(HEAD_TIMEOUT)

        def _body_too_slow(self) -> None:
            self._body_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
                return
            self._close(BODY_TIMEOUT)

        def _close(self, timeout_response: bytes | None = None) -> None:
            """Close the connection; first the 408 timeout_response when no response is
            under way."""
            if self.transport.is_closing():
                return
            if timeout_response is not None and self.conn.our_state is h11.IDLE:
                self.transport.write(timeout_response)
            with contextlib.suppress(h11.LocalProtocolError):  # (a response under way:
                self.conn.send(h11.ConnectionClosed())  # it is cut off)
            self.transport.close()

    return TimeoutProtocol
