"""What one client may ask of the server, and who may ask: the limits and the access
rules `mhsa serve` takes as options (each has a default fit for one machine)."""

from __future__ import annotations

from dataclasses import dataclass

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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("header_seconds", "body_seconds", "template_seconds", "drain_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")


@dataclass(frozen=True)
class Access:
    """api_key: every /v1 route needs `Authorization: Bearer <api_key>` (None: open);
    allowed_hosts: Host header values the server answers (DNS rebinding), "*" for any."""

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = LOOPBACK

    @classmethod
    def for_host(cls, host: str, api_key: str | None = None, extra=()) -> Access:
        """The loopback names, the bound host and extra as the allowed hosts."""
        hosts = dict.fromkeys([*LOOPBACK, host, *extra])
        return cls(api_key or None, tuple(hosts))


def exposed(host: str) -> bool:
    """Whether binding host reaches beyond this machine."""
    return host not in LOOPBACK and not host.startswith("127.")
