"""ApiError: an HTTP error with OpenAI's error body, raised anywhere a request goes wrong."""

from __future__ import annotations

from typing import Any

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A request that cannot be served: ``status`` plus ``{"error": {...}}`` like OpenAI's."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def error_type(self) -> str:
        """OpenAI's ``type`` for this status."""
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def response(self) -> web.Response:
        """This error as an aiohttp JSON response."""
        return web.json_response(self.body(), status=self.status, headers=self.headers)
