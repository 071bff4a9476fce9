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


@pytest.mark.parametrize(
    "host",
    [
        "localhost:80@attacker.example",  # userinfo: the name is attacker.example
        "127.0.0.1@attacker.example",
        "user@localhost",
        "localhost:99999",  # a port out of range
        "localhost:8o",
        "localhost:80:80",
        "localhost:-1",
        "localhost/evil",
        "localhost evil",
        "[::1",
        "[::1]x",
        "[::1]:80@attacker.example",
        "[not-an-ip]",
        "",
    ],
)
def test_a_host_header_that_is_not_host_and_port_is_refused(start_server, host):
    server = start_server()
    status, answer, _ = request(server.port, "GET", "/v1/models", headers={"Host": host})
    assert status == 400 and answer["error"]["code"] == "invalid_host", host
    anyone = start_server(access=Access(allowed_hosts=("*",)))  # any name, but a name
    status, answer, _ = request(anyone.port, "GET", "/v1/models", headers={"Host": host})
    assert status == 400 and answer["error"]["code"] == "invalid_host", host


def test_host_names_match_as_names(start_server):
    server = start_server(access=Access.for_host("127.0.0.1", extra=["My.Host", "[::1]"]))
    for host in ("LOCALHOST:8000", "my.host", "my.HOST:1", "[0:0::1]:80", "localhost:"):
        assert request(server.port, "GET", "/health", headers={"Host": host})[0] == 200, host
    with pytest.raises(ValueError, match="my.host:8000"):
        Access.for_host("127.0.0.1", extra=["my.host:8000"])  # (a port is no host name)


def test_several_keys_each_open_the_server_with_a_prefix_cache_of_its_own(start_server):
    server = start_server(access=Access.for_host("127.0.0.1", ["alice-key", "bob-key"]))
    prompt = "a shared system prompt of more than sixteen bytes, then a question"

    def cached(api_key: str) -> int:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        auth = {"Authorization": f"Bearer {api_key}"}
        status, answer, _ = request(server.port, "POST", "/v1/completions", body, auth)
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice-key") == 0
    assert cached("alice-key") == 64  # her own prefix: 4 blocks of 16 bytes
    assert cached("bob-key") == 0  # another key, another namespace
    assert cached("bob-key") == 64
    for key in ("carol-key", "alice-key bob-key", "alice-keybob-key", ""):
        auth = {"Authorization": f"Bearer {key}"}
        status, answer, _ = request(server.port, "POST", "/v1/completions", BODY, auth)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", key


@pytest.mark.parametrize("key", ["", "two words", "tab\tkey", "caf\u00e9", 3])
def test_an_api_key_that_no_header_can_carry_is_refused(key):
    with pytest.raises(ValueError, match="an API key is a string"):
        Access.for_host("127.0.0.1", [key])


def _args(host: str, key: str | None = None, key_file=None) -> argparse.Namespace:
    return argparse.Namespace(
        host=host,
        api_key=None if key is None else [key],
        api_key_file=key_file,
        allowed_hosts="a.example, b.example",
    )


def test_api_keys_come_from_repeated_options_and_a_file(tmp_path, monkeypatch, capsys):
    from mhsa.cli import build_parser

    monkeypatch.setenv("MHSA_API_KEY", "from-env")  # (options take its place)
    keys = tmp_path / "keys.txt"
    keys.write_text("# one key a line\n\nfile-one\n  file-two  \nkey-a\n")
    args = build_parser().parse_args(
        ["serve", "--api-key", "key-a", "--api-key", "key-b", "--api-key-file", str(keys)]
    )
    assert _access(args).api_keys == ("key-a", "key-b", "file-one", "file-two")
    args = build_parser().parse_args(["serve", "--api-key-file", str(keys)])
    assert _access(args).api_keys == ("file-one", "file-two", "key-a")
    assert _access(build_parser().parse_args(["serve"])).api_keys == ("from-env",)
    capsys.readouterr()


def test_a_bad_api_key_file_is_a_one_line_error(tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(ValueError, match="--api-key-file .*missing.txt"):
        _access(_args("127.0.0.1", key_file=str(missing)))
    empty = tmp_path / "empty.txt"
    empty.write_text("# no key yet\n\n")
    with pytest.raises(ValueError, match="empty.txt.*no key"):
        _access(_args("127.0.0.1", key_file=str(empty)))
    spaced = tmp_path / "spaced.txt"
    spaced.write_text("good-key\ntwo words\n")
    with pytest.raises(ValueError, match="spaced.txt, line 2"):
        _access(_args("127.0.0.1", key_file=str(spaced)))


def test_binding_beyond_loopback_without_a_key_warns(capsys, monkeypatch):
    monkeypatch.delenv("MHSA_API_KEY", raising=False)
    access = _access(_args("0.0.0.0"))
    warning = capsys.readouterr().err
    assert "warning" in warning and "0.0.0.0" in warning and "--api-key" in warning
    assert access.api_keys == ()
    assert access.allowed_hosts == (
        "localhost",
        "127.0.0.1",
        "::1",
        "0.0.0.0",
        "a.example",
        "b.example",
    )
    assert _access(_args("0.0.0.0", "k")).api_keys == ("k",)
    assert capsys.readouterr().err == ""  # (a key, and --allowed-hosts names the hosts)
    bare = argparse.Namespace(host="0.0.0.0", api_key=["k"], api_key_file=None, allowed_hosts=None)
    assert _access(bare).allowed_hosts == ("localhost", "127.0.0.1", "::1", "0.0.0.0")
    assert "--allowed-hosts" in capsys.readouterr().err
    assert _access(_args("127.0.0.1")).api_keys == ()
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MHSA_API_KEY", "from-env")
    assert _access(_args("192.168.1.5")).api_keys == ("from-env",)
    assert capsys.readouterr().err == ""
