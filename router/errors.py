"""The router's two exceptions: `RouterError` ends a request (or a call) with a status a
client can act on; `AttemptFailed` ends one attempt of a request, which may be replayed."""

from __future__ import annotations

from workers.messages import Status

# Trailing metadata on every status a router decides (a failed request, a refusal), as
# opposed to the connection or the router breaking: a client resuming elsewhere stops there.
FINAL_KEY = "tandem-final"


class RouterError(Exception):
    """Ends a call with `status` (sent as the gRPC status of that name) and a message that
    says what to do about it. `final`: the request's own outcome, which trying again cannot
    change (a client resuming on another router stops there); not final: a passing condition
    of this router or its store, worth a retry (after `retry_after_s`, when it is known: sent
    as gRPC trailing metadata `retry-after` and HTTP's Retry-After, in whole seconds)."""

    def __init__(
        self, status: Status, message: str, final: bool = True, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.final = final
        self.retry_after_s = retry_after_s  # when trying again may succeed (a quota's refill)


class AttemptFailed(Exception):
    """One attempt failed with `status` (UNAVAILABLE: it may be replayed) for `reason`."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason
