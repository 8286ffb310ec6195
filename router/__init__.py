"""The gRPC router, in parts, each a package whose docstring says what it owns:

- `edge`: the gRPC and OpenAI-compatible HTTP servers, validation, keys and TLS;
- `admission`: tenants, quotas, predictions and the slot queue in fair order;
- `requests`: the Router and each request's driver, stream and replays;
- `fleet`: the workers, where a request goes and the calls that put it there;
- `records`: each request's record and token log in the store.

Beside them: `config`, `errors`, `metrics`, `tenant_policy` (used by every part), the
generated `api`, and `controller` (the duties one router performs for the cluster). A part
imports only the parts below it, in that list read from the bottom (tests/unit/
test_boundaries.py).
"""
