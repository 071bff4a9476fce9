"""What one client may ask of the server, and who may ask: the limits and the access
rules `mhsa serve` takes as options (each has a default fit for one machine)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ...core.checks import int_at_least

LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Limits:
    """max_body_bytes: a request body larger is refused (413) before it is read whole;
    max_prompts: prompts in one /v1/completions request (an array of them);
    max_queued: requests waiting for room (beyond: 429 with Retry-After);
    retry_after: the seconds that 429 asks a client to wait;
    header_seconds: time a connection may take to send a request's head (request line
    and headers) after it opens or after its previous response (408 and closed beyond);
    body_seconds: time a client may take to send a request's body, in total from its
    head however steadily the bytes come (408 beyond; a connection whose body nobody
    reads is closed a second later: a slow sender holds no connection for ever);
    template_seconds, template_chars: time and output size of a chat template's rendering;
    drain_timeout: seconds running streams get to finish at shutdown."""

    max_body_bytes: int = 4 * 2**20
    max_prompts: int = 64
    max_queued: int = 256
    retry_after: int = 5
    header_seconds: float = 10.0
    body_seconds: float = 30.0
    template_seconds: float = 2.0
    template_chars: int = 1_000_000
    drain_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompts", "max_queued", "retry_after"):
            int_at_least(name, getattr(self, name), 1)
        for name in ("header_seconds", "body_seconds", "template_seconds", "drain_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")


@dataclass(frozen=True)
class Access:
    """api_keys: every /v1 route needs `Authorization: Bearer KEY` with one of them (none:
    open); each key is a prefix-cache namespace of its own, so clients with their own
    keys never see each other's cached prompts. allowed_hosts: the host names (or IP
    addresses, IPv6 ones without brackets) the Host header may name, against DNS
    rebinding; "*" for any (the header must still be a host[:port])."""

    api_keys: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = LOOPBACK

    def __post_init__(self) -> None:
        for key in self.api_keys:
            if not isinstance(key, str) or not _HEADER_TOKEN.fullmatch(key):
                what = f"a {type(key).__name__}" if not isinstance(key, str) else "this one"
                raise ValueError(  # (the key itself is not shown: it may be a secret)
                    f"an API key is a string of visible ASCII characters without spaces, "
                    f"which an Authorization header can carry; {what} is not"
                )
        names = []
        for host in self.allowed_hosts:
            bare = host.removeprefix("[").removesuffix("]")
            name = "*" if host == "*" else host_name(f"[{bare}]" if ":" in bare else bare)
            if name is None:
                raise ValueError(
                    f"allowed host {host!r} is not a host name or IP address (leave out "
                    "any port or scheme: 'example.com', '192.168.1.5', '::1')"
                )
            names.append(name)
        object.__setattr__(self, "api_keys", tuple(dict.fromkeys(self.api_keys)))
        object.__setattr__(self, "allowed_hosts", tuple(dict.fromkeys(names)))

    @classmethod
    def for_host(
        cls, host: str, api_keys: str | Iterable[str] | None = None, extra: Iterable[str] = ()
    ) -> Access:
        """The loopback names, the bound host and extra as the allowed hosts; api_keys:
        one key, several, or None (open)."""
        keys = (api_keys,) if isinstance(api_keys, str) else tuple(api_keys or ())
        return cls(keys, tuple(h for h in (*LOOPBACK, host, *extra) if h))


# A Host header: a name (or IPv4 address) or a bracketed IPv6 address, then an optional
# port, and nothing else: no userinfo ("localhost:80@evil.example"), path or spaces.
_HOST = re.compile(r"(?:\[(?P<ip6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::(?P<port>\d*))?")
_HEADER_TOKEN = re.compile(r"[\x21-\x7e]+")  # what a bearer token may hold


def host_name(authority: str) -> str | None:
    """The host a Host header names, in lower case ("[::1]:8000" -> "::1", "LocalHost" ->
    "localhost"), or None when it is not host[:port] (RFC 9110's uri-host [":" port], with
    names as DNS spells them)."""
    match = _HOST.fullmatch(authority)
    if match is None or (match["port"] and int(match["port"]) > 65535):
        return None
    if match["ip6"] is None:
        return match["name"].lower()
    try:
        return str(ipaddress.IPv6Address(match["ip6"]))  # (one spelling: "0:0::1" -> "::1")
    except ValueError:
        return None


def exposed(host: str) -> bool:
    """Whether binding host reaches beyond this machine."""
    return host not in LOOPBACK and not host.startswith("127.")
