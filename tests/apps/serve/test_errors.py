"""API errors in OpenAI's shape (mhsa.apps.serve.errors), without a server."""

from __future__ import annotations

import pytest

from mhsa.apps.serve import errors


def test_an_api_error_is_its_message_and_has_openai_s_body():
    error = errors.APIError(404, "no such model", param="model", code="model_not_found")
    assert str(error) == "no such model" and error.status == 404
    assert error.body() == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    with pytest.raises(TypeError):
        errors.APIError(400, "m", "param")  # param, code and kind are keywords
    assert errors.APIError(500, "x", kind="server_error").body()["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    "error, message, code",
    [
        (
            errors.below_minimum("max_tokens", 1, 0),
            "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, "
            "but got 0 instead.",
            "integer_below_min_value",
        ),
        (
            errors.above_maximum("temperature", 2.0, 3),
            "Invalid 'temperature': decimal above maximum value. Expected a value <= 2.0, "
            "but got 3 instead.",
            "decimal_above_max_value",
        ),
        (
            errors.missing("messages"),
            "Missing required parameter: 'messages'.",
            "missing_required_parameter",
        ),
        (
            errors.invalid_type("stream", "a boolean", None),
            "Invalid type for 'stream': expected a boolean, but got null instead.",
            "invalid_type",
        ),
        (
            errors.context_exceeded("prompt", 2048, 2000, 100),
            "This model's maximum context length is 2048 tokens. However, you requested 2100 "
            "tokens (2000 in the prompt, 100 in the completion). Please reduce the length of "
            "the prompt or the completion (max_tokens).",
            "context_length_exceeded",
        ),
    ],
)
def test_a_parameter_error_names_the_parameter_and_its_code(error, message, code):
    body = error.body()["error"]
    assert (error.status, body["message"], body["code"]) == (400, message, code)
    assert body["param"] == error.param and error.param in message
