"""Who may use a live server: with an API key every /v1 route needs `Authorization:
Bearer KEY` (401 in OpenAI's shape otherwise, /health stays open for probes), a POST
must be application/json (no cross-origin "simple" request), the Host header must be one
the server answers to (DNS rebinding), and `mhsa serve` warns when it binds beyond this
machine without a key."""

from __future__ import annotations

import argparse

import pytest
from live_server import openai_client, request

from mhsa.apps.serve.limits import Access
from mhsa.cli.serve import _access

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def test_every_v1_route_needs_the_key(start_server):
    openai = pytest.importorskip("openai")
    server = start_server(access=Access.for_host("127.0.0.1", "sesame"))
    for key in ("unused", "sesame2"):
        with pytest.raises(openai.AuthenticationError) as caught:
            openai_client(server, key).completions.create(**BODY)
        assert caught.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai_client(server, key).models.list()
    for path, method in [
        ("/v1/models", "GET"),
        ("/v1/models/tiny", "GET"),
        ("/v1/chat/completions", "POST"),
        ("/v1/nowhere", "GET"),
    ]:
        status, answer, _ = request(server.port, method, path, BODY)
        assert status == 401 and answer["error"]["type"] == "invalid_request_error", path
    assert openai_client(server, "sesame").completions.create(**BODY).usage.completion_tokens == 2
    assert request(server.port, "GET", "/health")[0] == 200  # (probes need no key)


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded"])
def test_a_post_that_is_not_json_is_refused(start_server, content_type):
    server = start_server()
    headers = {} if content_type is None else {"Content-Type": content_type}
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    status, answer, _ = request(server.port, "POST", "/v1/completions", body, headers)
    assert status == 415 and answer["error"]["code"] == "unsupported_media_type"
    assert server.served.engine.idle and "application/json" in answer["error"]["message"]
    json_type = {"Content-Type": "application/json; charset=utf-8"}
    assert request(server.port, "POST", "/v1/completions", body, json_type)[0] == 200


def test_a_foreign_host_header_is_refused(start_server):
    server = start_server()
    for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example"):
        status, answer, _ = request(server.port, "POST", "/v1/completions", BODY, {"Host": host})
        assert status == 400 and answer["error"]["code"] == "invalid_host", host
    for host in ("127.0.0.1", f"127.0.0.1:{server.port}", "localhost:1", "[::1]:8000"):
        status, _, _ = request(server.port, "POST", "/v1/completions", BODY, {"Host": host})
        assert status == 200, host
    wide = start_server(access=Access.for_host("127.0.0.1", extra=["my.host"]))
    assert request(wide.port, "GET", "/health", headers={"Host": "my.host:8000"})[0] == 200
    assert request(wide.port, "GET", "/health", headers={"Host": "evil.example"})[0] == 400


def _args(host: str, key: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(host=host, api_key=key, allowed_hosts="a.example, b.example")


def test_binding_beyond_loopback_without_a_key_warns(capsys, monkeypatch):
    monkeypatch.delenv("MHSA_API_KEY", raising=False)
    access = _access(_args("0.0.0.0"))
    warning = capsys.readouterr().err
    assert "warning" in warning and "0.0.0.0" in warning and "--api-key" in warning
    assert access.api_key is None
    assert access.allowed_hosts == (
        "localhost",
        "127.0.0.1",
        "::1",
        "0.0.0.0",
        "a.example",
        "b.example",
    )
    assert _access(_args("0.0.0.0", "k")).api_key == "k"
    assert capsys.readouterr().err == ""  # (a key, and --allowed-hosts names the hosts)
    bare = argparse.Namespace(host="0.0.0.0", api_key="k", allowed_hosts=None)
    assert _access(bare).allowed_hosts == ("localhost", "127.0.0.1", "::1", "0.0.0.0")
    assert "--allowed-hosts" in capsys.readouterr().err
    assert _access(_args("127.0.0.1")).api_key is None
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MHSA_API_KEY", "from-env")
    assert _access(_args("192.168.1.5")).api_key == "from-env"
    assert capsys.readouterr().err == ""
