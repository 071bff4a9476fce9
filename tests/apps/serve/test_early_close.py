"""A live server closes a connection whose request body it will not read: an error
answered before the body came whole (413, 401, 404, 405, 415) says `Connection: close`
and the connection ends even while the client keeps trickling body bytes; and a body
that keeps coming, byte after byte, is cut off once its total time is up (the limit is
on the whole body, not between bytes). Raw sockets with bounded waits: a connection the
server keeps open makes a test fail, never hang."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from mhsa.apps.serve.limits import Access, Limits
from optional import needs

KEY = "sesame"
JSON = "Content-Type: application/json\r\n"
AUTH = f"Authorization: Bearer {KEY}\r\n"

# status: the request head that gets it before its 5000-byte body is read
EARLY = {
    413: f"POST /v1/completions HTTP/1.1\r\n{JSON}{AUTH}",  # Content-Length over the limit
    401: f"POST /v1/completions HTTP/1.1\r\n{JSON}",  # no key
    404: f"POST /nowhere HTTP/1.1\r\n{JSON}",
    405: f"GET /v1/completions HTTP/1.1\r\n{AUTH}",
    415: f"POST /v1/completions HTTP/1.1\r\nContent-Type: text/plain\r\n{AUTH}",
}


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str]]:
    """The status and headers of one response (its body read too, by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"the connection closed before a whole response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(4096)
    return int(lines[0].split(" ")[1]), headers


def _closed_while_trickling(sock: socket.socket, seconds: float = 4.0) -> bool:
    """Send a body byte every 0.2 s for up to seconds; whether the server closed the
    connection meanwhile (end of stream, or a reset)."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"x")
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


@pytest.mark.parametrize("status", sorted(EARLY))
def test_an_error_before_the_body_closes_the_connection(start_server, status):
    # header_seconds and body_seconds far longer than the test waits: only the early
    # answer may close the connection
    limits = Limits(max_body_bytes=1000, header_seconds=30, body_seconds=30)
    server = start_server(limits=limits, access=Access.for_host("127.0.0.1", KEY))
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        head = EARLY[status] + "Host: 127.0.0.1\r\nContent-Length: 5000\r\n\r\n"
        sock.sendall(head.encode() + b'{"prompt": "')
        got, headers = _read_response(sock)
        assert got == status
        assert headers.get("connection") == "close", headers
        assert _closed_while_trickling(sock), "the connection stayed open"
    finally:
        sock.close()


def test_an_error_after_the_whole_body_keeps_the_connection(start_server):
    server = start_server(access=Access.for_host("127.0.0.1", KEY))
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        for _ in range(2):  # one connection, two whole requests, each answered
            body = b'{"prompt": 3}'
            head = f"POST /v1/completions HTTP/1.1\r\n{JSON}{AUTH}Host: 127.0.0.1\r\n"
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            status, headers = _read_response(sock)
            assert status == 400 and headers.get("connection") != "close"
    finally:
        sock.close()


def _endless_reader_server(body_seconds: float):
    """A uvicorn server with mhsa's protocol over an app that reads a request body for
    as long as it comes and sets no time limit of its own."""
    needs("uvicorn")
    import uvicorn

    from mhsa.apps.serve.protocol import timeout_protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive())["type"] == "http.request":
            pass

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        lifespan="off",
        log_level="error",
        http=timeout_protocol(header_seconds=30, body_seconds=body_seconds),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    return server, thread


def test_a_body_that_keeps_trickling_is_cut_off_in_total():
    server, thread = _endless_reader_server(body_seconds=0.5)
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\nx")
            assert _closed_while_trickling(sock), "a byte every 0.2 s held the connection"
        finally:
            sock.close()
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_body_seconds_of_the_protocol_is_checked():
    needs("uvicorn")
    from mhsa.apps.serve.protocol import timeout_protocol

    with pytest.raises(ValueError, match="body_seconds"):
        timeout_protocol(header_seconds=1, body_seconds=-1)
