"""The router's configuration: where it listens, how much it admits, how long it waits for
each step of a request, and how it replays failed attempts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from router.tenant_policy import TenantsConfig
from workers.engine.config import described
from workers.engine.orders import Side, order_names

ADMISSION_POLICIES = order_names(Side.ROUTER)  # the orders a router serves (orders.py)


class Mode(enum.StrEnum):
    """How a cluster runs a request's two phases."""

    DISAGGREGATED = "disaggregated"  # prefill and decode in pools of their own
    COLOCATED = "colocated"  # both in one worker, chunked prompts mixed into decode batches


@dataclass(frozen=True)
class RouterConfig:
    host: str = field(default="127.0.0.1", metadata=described("address the gRPC server binds"))
    port: int = field(default=50051, metadata=described("gRPC port (0 picks a free one)"))
    http_port: int | None = field(
        default=None,
        metadata=described(
            "OpenAI-compatible HTTP port on the same host (off unless set; 0 picks one)"
        ),
    )
    auth_token: str | None = field(
        default=None,
        metadata=described(
            "one key with every scope, of the tenant 'default' (a flag shows in ps: prefer "
            "the TANDEM_AUTH_TOKEN environment variable or api_keys_file)"
        ),
    )
    api_keys_file: str | None = field(
        default=None,
        metadata=described(
            "YAML file of API keys, each as its SHA-256 with a tenant and scopes "
            "(`tandem keys new`); with it or auth_token, every call needs a key"
        ),
    )
    tls_cert: str | None = field(
        default=None, metadata=described("PEM certificate: serve gRPC and HTTP over TLS only")
    )
    tls_key: str | None = field(default=None, metadata=described("PEM private key of tls_cert"))
    tls_client_ca: str | None = field(
        default=None,
        metadata=described("PEM CA: clients must present a certificate it signed (mutual TLS)"),
    )
    tls_ca: str | None = field(
        default=None,
        metadata=described(
            "PEM CA of the other routers' certificates, to verify the controller router "
            "this one forwards Admin calls to (default: tls_client_ca)"
        ),
    )
    max_in_flight: int = field(
        default=256,
        metadata=described(
            "sequences generating at once (a request of n choices takes n); with "
            "admission_fair_share, a tenant under its weighted share of them goes in past it"
        ),
    )
    admission_policy: str = field(
        default="fcfs",
        metadata=described(
            "order of the requests waiting for a slot, within a tier and (with "
            "admission_fair_share) behind the tenant least served: fcfs, priority (the "
            "request's, aged), sjf (least predicted cost), slack (least time to its TTFT "
            "deadline)",
            choices=ADMISSION_POLICIES,
        ),
    )
    admission_fair_share: bool = field(
        default=True,
        metadata=described("admit the tenant served least for its weight first (tokens, as VTC)"),
    )
    admission_aging_per_s: float = field(
        default=0.0,
        metadata=described("priority policy: priority a waiting request gains each second"),
    )
    admission_max_wait_s: float | None = field(
        default=None,
        metadata=described(
            "a request waiting this long for a slot goes ahead of all that have not "
            "(a tenant's own tenants.max_wait_s first; default: off)"
        ),
    )
    admission_shed_wait_s: float | None = field(
        default=None,
        metadata=described(
            "refuse a request whose predicted wait for a slot passes this many seconds "
            "(RESOURCE_EXHAUSTED, HTTP 429, with a retry-after) rather than queue it "
            "(default: off, every request queues up to max_queue)"
        ),
    )
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    max_resumes: int = field(
        default=1024, metadata=described("Resume streams open at once; past it: RESOURCE_EXHAUSTED")
    )
    max_queue: int = field(
        default=1024, metadata=described("requests waiting for a slot; past it: RESOURCE_EXHAUSTED")
    )
    reserve_timeout_s: float = field(
        default=60.0,
        metadata=described(
            "how long a request waits for room on a decode worker while none frees any (while "
            "they free blocks it waits on, up to prefill_timeout_s)"
        ),
    )
    prefill_timeout_s: float = field(
        default=300.0, metadata=described("longest wait for a prefill")
    )
    rpc_timeout_s: float = field(default=30.0, metadata=described("longest wait for a worker call"))
    status_interval_s: float = field(
        default=0.5, metadata=described("how often worker loads and liveness are refreshed")
    )
    stall_timeout_s: float = field(
        default=120.0,
        metadata=described(
            "an attempt with no token for this long is given up if its workers no longer "
            "hold it (one queued on a live worker waits on), and a worker whose engine step "
            "has run this long is marked dead (hung)"
        ),
    )
    local_prefill_max_tokens: int = field(
        default=0,
        metadata=described(
            "disaggregated mode: a request of at most this many tokens (its prompt, and on a "
            "replay the tokens already sent) is prefilled on its decode worker, mixed into "
            "its batches, with no prefill queue and no KV transfer; 0: never"
        ),
    )
    replay: bool = field(
        default=True, metadata=described("replay a request whose worker failed on another worker")
    )
    max_retries: int = field(
        default=3, metadata=described("replays of one request before it ends with UNAVAILABLE")
    )
    replay_wait_s: float = field(
        default=120.0,
        metadata=described("how long a replay waits for a live worker (e.g. a replacement)"),
    )

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if not 0 <= self.port < 65536:
            raise bad("port", "must be a TCP port (0 picks a free one)")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise bad("http_port", "must be a TCP port (0 picks a free one)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise bad("tls_cert", "tls_cert and tls_key go together")
        for name in ("tls_client_ca", "tls_ca"):
            if getattr(self, name) and not self.tls_cert:
                raise bad(name, "needs tls_cert and tls_key: the router must serve TLS")
        if self.max_in_flight < 1:  # 0 slots: every request would wait forever (G6)
            raise bad("max_in_flight", "must be at least 1")
        if self.max_resumes < 1:
            raise bad("max_resumes", "must be at least 1")
        for name in ("max_queue", "local_prefill_max_tokens"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        for name in (
            "reserve_timeout_s",
            "prefill_timeout_s",
            "rpc_timeout_s",
            "status_interval_s",
            "stall_timeout_s",
            "replay_wait_s",
        ):
            if getattr(self, name) <= 0:
                raise bad(name, "must be positive")
        if self.max_retries < 0:
            raise bad("max_retries", "must be >= 0")
        if self.admission_policy not in ADMISSION_POLICIES:
            raise bad("admission_policy", f"choose {', '.join(ADMISSION_POLICIES)}")
        if self.admission_aging_per_s < 0:
            raise bad("admission_aging_per_s", "must be >= 0")
        for name in ("admission_max_wait_s", "admission_shed_wait_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise bad(name, "must be positive (or unset)")
