"""Domain errors shared by the three services.

Domain code raises these (it never imports grpc); `tito.grpc_errors` maps them to gRPC status
codes with `google.rpc` details in exactly one place per server. Anything else that escapes a
handler is a bug in tito and becomes INTERNAL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

#: Characters of a caller's string an error message repeats; the rest is elided.
QUOTE_CHARS = 64


def quoted(text: str, limit: int = QUOTE_CHARS) -> str:
    """`text` as a Python literal ('...'), cut to its first `limit` characters (then '...' and
    the full length), so a caller's megabyte name or id cannot fill an error message."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


class ConfigError(ValueError):
    """A start-up configuration value is wrong; the message says how to fix it. (Not a TitoError:
    it never reaches a caller; the CLI prints it as one line and exits with status 2.)"""


@dataclass(frozen=True)
class FieldViolation:
    """One offending request field: a dotted path (e.g. "messages[2].role") and what is wrong."""

    field: str
    description: str


class TitoError(Exception):
    """Base of errors a caller can act on. `reason` is an UPPER_SNAKE machine-readable code."""

    code_name = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        field: str | None = None,
        violations: list[FieldViolation] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.violations = list(violations or [])
        if field is not None:
            self.violations.insert(0, FieldViolation(field, message))
        self.metadata = dict(metadata or {})

    @property
    def field(self) -> str | None:
        return self.violations[0].field if self.violations else None

    def __reduce__(self):
        # Keyword-only arguments defeat Exception's default pickling; errors found in the engine's
        # core process must cross the pipe whole (same class, code, reason, fields, metadata).
        return _rebuild_error, (type(self), self.message, self.reason, tuple(self.violations), self.metadata)


def _rebuild_error(error_type: type[TitoError], message: str, reason: str,
                   violations: tuple[FieldViolation, ...], metadata: dict[str, str]) -> TitoError:
    return error_type(message, reason=reason, violations=list(violations), metadata=metadata)


class InvalidArgument(TitoError):
    """The request itself is malformed or out of range; retrying it unchanged cannot succeed."""

    code_name = "INVALID_ARGUMENT"


class FailedPrecondition(TitoError):
    """The request is well-formed but the server's state cannot serve it (e.g. missing tensors)."""

    code_name = "FAILED_PRECONDITION"


class ResourceExhausted(TitoError):
    """A limit was hit (sizes, queue, KV memory); the caller may retry later or send less."""

    code_name = "RESOURCE_EXHAUSTED"


class NotFound(TitoError):
    """A named thing (request id, cache entry) does not exist."""

    code_name = "NOT_FOUND"


class AlreadyExists(TitoError):
    """A thing the caller asked to create (by name) exists already."""

    code_name = "ALREADY_EXISTS"


class OutOfRange(TitoError):
    """A position the caller named (e.g. a sequence number) lies outside what the server holds."""

    code_name = "OUT_OF_RANGE"


class Unimplemented(TitoError):
    """The contract defines this capability but this server does not provide it yet."""

    code_name = "UNIMPLEMENTED"


class Unauthenticated(TitoError):
    """The call carries no valid credentials (bearer token) for this server."""

    code_name = "UNAUTHENTICATED"


class PermissionDenied(TitoError):
    """The caller is known but may not have what it names (e.g. a KV transfer handle that does not
    verify)."""

    code_name = "PERMISSION_DENIED"


class Unavailable(TitoError):
    """The server is not ready (model loading) or is shutting down; retry elsewhere or later."""

    code_name = "UNAVAILABLE"


def still_loading(service: str) -> Unavailable:
    """The one answer of every service between binding its port and having its model loaded."""
    return Unavailable(f"{service} is still loading its model; retry shortly", reason="MODEL_LOADING")


class LoadingGate(Generic[T]):
    """What a service serves with once its model is loaded (a backend, a tokenizer, a renderer).
    Every service binds its port first, so calls that come earlier get `still_loading`: the one
    loading gate of all three services."""

    def __init__(self, service: str, value: T | None = None):
        self._service = service
        self._value = value

    def open(self, value: T) -> None:
        self._value = value

    @property
    def is_open(self) -> bool:
        return self._value is not None

    def get(self) -> T:
        """The loaded value, or UNAVAILABLE MODEL_LOADING while there is none yet."""
        if self._value is None:
            raise still_loading(self._service)
        return self._value


@dataclass
class Violations:
    """Collects field violations so a validator can report them all at once."""

    items: list[FieldViolation] = field(default_factory=list)

    def add(self, field_path: str, description: str) -> None:
        self.items.append(FieldViolation(field_path, description))

    def raise_if_any(self, reason: str = "INVALID_REQUEST") -> None:
        if self.items:
            first = self.items[0]
            more = f" (and {len(self.items) - 1} more)" if len(self.items) > 1 else ""
            raise InvalidArgument(f"{first.field}: {first.description}{more}", reason=reason,
                                  violations=self.items)
