"""The router's own answers to a client, OpenAI-shaped: built here, once.

`{"error": {"message", "type", "param", "code"}}` is what OpenAI's clients parse; the
message never carries an engine's text or address (see `LegFailure.public`).
"""

from __future__ import annotations

from serving.http_messages import INVALID_REQUEST, Response, openai_error

__all__ = ["INVALID_REQUEST", "no_capacity", "openai_error", "unauthorized",
           "upstream_failed"]


def unauthorized() -> Response:
    return openai_error(401, "missing or wrong API key (Authorization: Bearer ...)",
                        INVALID_REQUEST, "invalid_api_key")


def no_capacity(model: str, *, known: bool) -> Response:
    """404 for a model no member serves or has served; 503 for one that has none
    routable right now (clients retry a 503, not a 404)."""
    if not known:
        return openai_error(404, f"the model {model!r} does not exist", INVALID_REQUEST,
                            "model_not_found")
    return openai_error(503, f"no routable prefill and decode for model {model!r}",
                        "service_unavailable", "no_capacity", {"Retry-After": "1"})


def upstream_failed(public: str) -> Response:
    """502 when every pair tried failed; `public`: the last failure, as a client may see it."""
    return openai_error(502, f"no pair could serve the request; last: {public}",
                        "upstream_error", "upstream_failed")
