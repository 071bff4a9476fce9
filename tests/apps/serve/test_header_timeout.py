"""The header read timeout of `mhsa serve` (Limits.header_seconds, --header-seconds)
against a live server on 127.0.0.1: a connection that sends its request head too
slowly (slowloris), or nothing at all, gets a 408 and is closed, while /health and
whole requests are served meanwhile; a keep-alive connection's next head is timed
afresh after each response."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
from live_server import request

from mhsa.apps.serve.limits import Limits


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_a_head_sent_too_slowly_gets_408_and_the_connection_closes(start_server):
    server = start_server(limits=Limits(header_seconds=0.5))
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    started = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    for _ in range(3):  # a header line now and then, never the end of the head
        time.sleep(0.1)
        sock.sendall(b"X-Slow: 1\r\n")
    assert request(server.port, "GET", "/health", timeout=5)[0] == 200  # served meanwhile
    reply = _read_until_closed(sock)
    sock.close()
    assert reply.split(b" ")[1] == b"408"
    assert time.monotonic() - started < 10


def test_a_silent_connection_is_closed(start_server):
    server = start_server(limits=Limits(header_seconds=0.3))
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    assert _read_until_closed(sock).startswith(b"HTTP/1.1 408")
    sock.close()


def test_keep_alive_requests_in_time_are_served_and_the_next_head_is_timed(start_server):
    server = start_server(limits=Limits(header_seconds=0.5))
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for _ in range(3):  # one connection, three requests, each head within the limit
        time.sleep(0.2)
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["status"] == "ok"
    sock = connection.sock
    sock.sendall(b"GET /health HTTP/1.1\r\n")  # a fourth head that never ends
    assert _read_until_closed(sock).startswith(b"HTTP/1.1 408")
    connection.close()


def test_header_seconds_is_checked():
    with pytest.raises(ValueError, match="header_seconds"):
        Limits(header_seconds=-1)
