"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

A request the server cannot serve raises APIError; the app turns it into a JSON
response with its status (400 for a bad parameter, 404 for an unknown model or URL)
and the server carries on."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any


@dataclass(eq=False)
class APIError(Exception):
    """An error reported to the client: HTTP status, message, the parameter at fault
    (or None), OpenAI's machine-readable code (or None) and its type."""

    status: int
    message: str
    _: KW_ONLY
    param: str | None = None
    code: str | None = None
    kind: str = "invalid_request_error"
    headers: dict[str, str] | None = None  # extra response headers (Retry-After...)

    def __post_init__(self) -> None:
        super().__init__(self.message)  # str(error) is the message

    def body(self) -> dict[str, Any]:
        """The JSON body of the response (or of the stream's error event)."""
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}


def invalid_json(detail: str) -> APIError:
    return APIError(
        400,
        "We could not parse the JSON body of your request: "
        f"{detail}. Send a JSON object (Content-Type: application/json).",
        code="invalid_json",
    )


def bad_param(param: str, message: str, code: str) -> APIError:
    """The 400 error about one request parameter: OpenAI's message and code for it."""
    return APIError(400, message, param=param, code=code)


def missing(param: str) -> APIError:
    return bad_param(param, f"Missing required parameter: '{param}'.", "missing_required_parameter")


def invalid_type(param: str, expected: str, value: Any) -> APIError:
    message = f"Invalid type for '{param}': expected {expected}, but got {_kind(value)} instead."
    return bad_param(param, message, "invalid_type")


def invalid_value(param: str, message: str) -> APIError:
    return bad_param(param, f"Invalid '{param}': {message}", "invalid_value")


def below_minimum(param: str, minimum: float, value: Any) -> APIError:
    return _out_of_range(param, value, minimum, "below", "minimum")


def above_maximum(param: str, maximum: float, value: Any) -> APIError:
    return _out_of_range(param, value, maximum, "above", "maximum")


def _out_of_range(param: str, value: Any, bound: float, side: str, limit: str) -> APIError:
    """below_minimum (side "below", limit "minimum") or above_maximum ("above", "maximum")."""
    kind = "integer" if isinstance(bound, int) else "decimal"
    relation = ">=" if side == "below" else "<="
    message = (
        f"Invalid '{param}': {kind} {side} {limit} value. Expected a value "
        f"{relation} {bound}, but got {value} instead."
    )
    return bad_param(param, message, f"{kind}_{side}_{limit[:3]}_value")


def unsupported(param: str, why: str = "") -> APIError:
    message = f"'{param}' is not supported by this server{why}; leave it out."
    return bad_param(param, message, "unsupported_parameter")


def unrecognized(param: str) -> APIError:
    message = (
        f"Unrecognized request argument supplied: {param}. This server does not "
        "implement it; leave it out."
    )
    return bad_param(param, message, "unknown_parameter")


def unknown_model(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model `{name}` does not exist: this server serves "
        f"`{served}` (GET /v1/models lists it).",
        param="model",
        code="model_not_found",
    )


def context_exceeded(param: str, context: int, prompt: int, new: int | None) -> APIError:
    asked = prompt + (new or 0)
    detail = f" ({prompt} in the {param}, {new} in the completion)" if new else ""
    message = (
        f"This model's maximum context length is {context} tokens. However, "
        f"you requested {asked} tokens{detail}. Please reduce the length of the "
        f"{param} or the completion (max_tokens)."
    )
    return bad_param(param, message, "context_length_exceeded")


def prompt_too_long(param: str, context: int, at_least: int) -> APIError:
    """context_exceeded for a prompt refused before it was tokenised whole: its count is
    a lower bound."""
    message = (
        f"This model's maximum context length is {context} tokens. However, your "
        f"{param} has at least {at_least} tokens (it was not tokenised to the end). "
        f"Please reduce the length of the {param}."
    )
    return bad_param(param, message, "context_length_exceeded")


def body_too_large(limit: int, declared: str | None) -> APIError:
    got = f" (Content-Length {declared})" if declared is not None else ""
    return APIError(
        413,
        f"The request body is larger than this server accepts{got}: at most {limit} bytes "
        "(mhsa serve --max-body-bytes). Send a shorter request.",
        code="request_too_large",
    )


def body_timeout(seconds: float) -> APIError:
    return APIError(
        408,
        f"The request body did not arrive within {seconds:g} s (mhsa serve --body-seconds). "
        "Send it whole, promptly.",
        code="request_timeout",
        headers={"Connection": "close"},
    )


def too_many_prompts(count: int, limit: int) -> APIError:
    return bad_param(
        "prompt",
        f"Invalid 'prompt': {count} prompts in one request, this server takes at most "
        f"{limit} (mhsa serve --max-prompts). Split them over several requests.",
        "too_many_prompts",
    )


def queue_full(queued: int, limit: int, retry_after: int) -> APIError:
    return APIError(
        429,
        f"The server is busy: {queued} requests are waiting and it queues at most {limit} "
        f"(mhsa serve --max-queued). Retry in {retry_after} s.",
        code="queue_full",
        kind="rate_limit_error",
        headers={"Retry-After": str(retry_after)},
    )


def shutting_down() -> APIError:
    return APIError(
        503,
        "The server is shutting down and takes no new requests.",
        code="shutting_down",
        kind="server_error",
        headers={"Retry-After": "10", "Connection": "close"},
    )


def _kind(value: Any) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a decimal",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)
