"""The router's two exceptions: `RouterError` ends a request (or a call) with a status a
client can act on; `AttemptFailed` ends one attempt of a request, which may be replayed."""

from __future__ import annotations

from workers.messages import Status


class RouterError(Exception):
    """Ends a call with `status` (sent as the gRPC status of that name) and a message that
    says what to do about it. `final`: the request's own outcome, which trying again cannot
    change (a client resuming on another router stops there); not final: a passing condition
    of this router or its store, worth a retry."""

    def __init__(self, status: Status, message: str, final: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.final = final


class AttemptFailed(Exception):
    """One attempt failed with `status` (UNAVAILABLE: it may be replayed) for `reason`."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason
