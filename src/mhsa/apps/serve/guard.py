"""The checks every request passes before a route sees it (an ASGI middleware): the Host
header is a host[:port] the server answers to (against DNS rebinding), /v1 routes carry
one of the API keys when there are any, a POST is sent as application/json (so no web
page can send it as a cross-origin "simple" request), and no new request starts while
the server shuts down. A response sent before its request's body was read whole says
`Connection: close`."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from . import errors
from .limits import Access, host_name


class Gate:
    """Whether the server takes new requests (closed at shutdown)."""

    def __init__(self) -> None:
        self.open = True


class Guard:
    """ASGI middleware: refuse a request that fails access's rules or comes once gate is
    closed, with an error in OpenAI's shape; pass the rest to app."""

    def __init__(self, app: Any, *, access: Access, gate: Gate | None = None) -> None:
        self.app, self.access, self.gate = app, access, gate or Gate()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        receive, send = _close_if_answered_early(scope, receive, send)
        error = self.check(scope)
        if error is not None:
            response = JSONResponse(error.body(), error.status, headers=error.headers)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def check(self, scope: dict) -> errors.APIError | None:
        """The error to answer the request with, or None to serve it."""
        headers = Headers(scope=scope)
        given = headers.get("host", "")
        host = host_name(given)
        if host is None:
            return errors.APIError(
                400,
                f"Invalid Host header {given!r}: expected a host name or IP address and "
                "an optional port (host[:port], as in 'localhost:8000' or '[::1]:8000').",
                code="invalid_host",
            )
        allowed = self.access.allowed_hosts
        if "*" not in allowed and host not in allowed:
            return errors.APIError(
                400,
                f"Invalid Host header {given!r}: this server answers to "
                f"{', '.join(allowed)} (mhsa serve --allowed-hosts).",
                code="invalid_host",
            )
        path = scope["path"]
        if path.startswith("/v1") and self.access.api_keys:
            given = headers.get("authorization", "")
            # every key compared, so the time taken tells nothing of which came near
            matches = [
                hmac.compare_digest(given.encode(), f"Bearer {key}".encode())
                for key in self.access.api_keys
            ]
            if not any(matches):
                what = "an incorrect" if given else "no"
                return errors.APIError(
                    401,
                    f"You provided {what} API key. Send it as 'Authorization: Bearer KEY' "
                    "(a key mhsa serve was started with: --api-key, --api-key-file or "
                    "MHSA_API_KEY).",
                    code="invalid_api_key",
                )
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return errors.APIError(
                    415,
                    f"Unsupported Content-Type {media or 'none'!r}: send the body as JSON "
                    "with 'Content-Type: application/json'.",
                    code="unsupported_media_type",
                )
        if path != "/health" and not self.gate.open:
            return errors.shutting_down()
        return None


def _close_if_answered_early(scope: dict, receive: Any, send: Any) -> tuple[Any, Any]:
    """receive and send, wrapped so that a response that starts before the request's body
    was received whole (an early error: 413, 401, 404...) says `Connection: close`: the
    rest of that body is never read, so the connection cannot serve another request
    (the protocol closes it; the header tells the client why)."""
    headers = Headers(scope=scope)
    length = headers.get("content-length", "0").strip()
    whole = "transfer-encoding" not in headers and length in ("", "0")
    state = {"whole": whole}

    async def receive_whole() -> dict:
        message = await receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            state["whole"] = True
        return message

    async def send_closing(message: dict) -> None:
        if message["type"] == "http.response.start" and not state["whole"]:
            listed = list(message.get("headers", []))
            if not any(name.lower() == b"connection" for name, _ in listed):
                message = {**message, "headers": [*listed, (b"connection", b"close")]}
        await send(message)

    return receive_whole, send_closing
