"""Tandem's client library: what `tandem generate --address`, `tandem status`, the admin verbs
and the benchmarks use to call a router. It imports no torch.

- `client`: `TandemClient` (generate with resume across routers, cancel, status, the admin
  stub), `StreamResult`, and `to_proto` for the offline API's requests;
- `channel`: the channels it calls over, which attach its API key to every call.
"""

from client.client import (
    StreamResult,
    TandemClient,
    fetch_status,
    status_to_dict,
    tenants_to_dict,
    to_proto,
)

__all__ = [
    "StreamResult",
    "TandemClient",
    "fetch_status",
    "status_to_dict",
    "tenants_to_dict",
    "to_proto",
]
