"""The one exception that ends a request at the router with a status a client can act on."""

from __future__ import annotations

from workers.messages import Status


class RouterError(Exception):
    """Ends a call with `status` (sent as the gRPC status of that name) and a message that
    says what to do about it."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
