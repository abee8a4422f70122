"""The error a client request fails with, shared by the tokenizer process and the HTTP API."""

from __future__ import annotations


class RequestError(Exception):
    """A request that fails; `kind` maps to an HTTP status and an OpenAI error type."""

    STATUS = {"invalid_request": 400, "unauthorized": 401, "not_found": 404,
              "payload_too_large": 413, "overloaded": 503, "unavailable": 503, "internal": 500}

    def __init__(self, message: str, kind: str = "invalid_request", param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.param = param
        self.retry_after = retry_after  # seconds, sent as Retry-After with a 503

    @property
    def status(self) -> int:
        return self.STATUS.get(self.kind, 500)
