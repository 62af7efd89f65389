"""vLLM's error JSON, as its scale-out endpoints answer it:

    {"error": {"message": "...", "type": "BadRequestError", "param": "token_ids", "code": 400}}

`code` is the HTTP status (OpenAI's shape, as tito's own endpoints answer, puts the reason
there); the gateway's one mapping (errors.from_exception) chooses the status and the parameter,
so a refusal has the same status on both faces."""

from __future__ import annotations

from tito_gateway.errors import HttpError

#: vLLM's `type` for a status (BaseServing.create_error_response and its handlers).
ERROR_TYPES = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 409: "ConflictError",
               413: "BadRequestError", 429: "TooManyRequests", 499: "ClientClosedRequest",
               501: "NotImplementedError", 503: "ServiceUnavailableError", 504: "GatewayTimeout"}

#: Field-path prefixes of the engine's and render's messages that vLLM's bodies do not have.
ENGINE_PREFIXES = ("generate_request.", "request.")


def error_json(error: HttpError, param: str | None = None) -> dict:
    """`error` in vLLM's shape. `param`: the field as the vLLM body names it, when the caller
    knows it better than the service that refused (a sampling field is `sampling_params.x`)."""
    kind = ERROR_TYPES.get(error.status, "InternalServerError" if error.status >= 500 else "BadRequestError")
    return {"error": {"message": error.message, "type": kind, "param": param or error.param, "code": error.status}}
