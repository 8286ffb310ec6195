"""Request state in Redis: the router's RequestStore (asyncio) and the decode workers'
TokenLog (blocking, picklable), over one key schema:

    tandem:req:<id>            hash: prompt_ids, sampling, priority, tenant, state, owner,
                               attempt, prefill, decode, created, updated, finish_reason, error,
                               choices (n; each choice of an n > 1 request has a record, <id>#i)
    tandem:req:<id>:tokens     list: output token ids, in order
    tandem:req:<id>:failures   list: why each failed attempt failed
    tandem:active              set: ids of records not yet terminal
    tandem:router:<id>         string with a TTL: a live router's gRPC address (heartbeat)
    tandem:lease:<name>        string with a TTL: who holds a lease (e.g. the controller)

Token writes carry their output offset and attempt, and run as one script: tokens the log
already holds are skipped, a gap is reported (the writer sends again from the log's end), and
a write from an attempt older than the record's is refused (fenced); a newer one raises the
record's attempt (its router's note of it may not have landed yet). So any number of writes
may be repeated, and a stale worker can never corrupt a log. Terminal records get a TTL.
Every call has a socket timeout (G6): a Redis that stops answering raises, it never hangs.
A Redis that cannot be reached raises the builtin ConnectionError (what callers treat as "the
store is away, keep the writes"); any other error is a bug and surfaces as itself.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
from dataclasses import replace
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from cluster.state_scripts import (
    APPEND_SCRIPT,
    BEGIN_SCRIPT,
    CLAIM_SCRIPT,
    CREATE_SCRIPT,
    LEASE_SCRIPT,
    RAISE_SCRIPT,
    TENANTS_SCRIPT,
    VOID_SCRIPT,
)
from router.records.store import BeginResult, RecordState, RequestRecord
from workers.engine.request import FinishReason
from workers.messages import (
    LogAck,
    LogResult,
    LogWrite,
    Status,
    sampling_from_dict,
    sampling_to_dict,
)

PREFIX = "tandem:"
ACTIVE = PREFIX + "active"
TENANTS = PREFIX + "tenants"  # the run-time changes of the tenants' policies
TERMINAL = tuple(s.value for s in RecordState if s.terminal)

_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError)
# A Redis that answers but takes no writes for now (out of memory, its disk full or failing
# under AOF, a replica): as good as away, and as likely to come back.
# redis-py names some of these errors by class, and leaves the others' codes in the message.
_REFUSING = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.MasterDownError,
    redis.exceptions.TryAgainError,
)
_REFUSING_CODES = ("OOM", "MISCONF", "READONLY", "MASTERDOWN", "NOREPLICAS", "TRYAGAIN")


def _away(e: Exception) -> ConnectionError | None:
    """The builtin ConnectionError for a Redis error that means the store is away or refuses
    writes for now; None for any other error (a bug: it propagates as it is)."""
    # A pipeline's error reads "Command # 1 (...) of pipeline caused error: MISCONF ...".
    said = str(e).rpartition("caused error: ")[2]
    if isinstance(e, _UNREACHABLE + _REFUSING) or (
        isinstance(e, redis.ResponseError) and said.startswith(_REFUSING_CODES)
    ):
        return ConnectionError(f"{type(e).__name__}: {e}")
    return None


def _raise_as_away(e: Exception) -> None:
    """Raise `e` as _away has it: the builtin ConnectionError, or else `e` itself."""
    away = _away(e)
    if away is None:
        raise e
    raise away from e


def _reachable(fn):
    """Redis's connection and timeout errors, and its refusals of writes, as the builtin
    ConnectionError."""

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except (redis.RedisError, OSError) as e:
            _raise_as_away(e)

    return wrapper


def key(request_id: str) -> str:
    return f"{PREFIX}req:{request_id}"


def redact(url: str) -> str:
    """The URL without its password, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def _fields(rec: RequestRecord) -> dict:
    now = str(time.time())
    return {
        "prompt_ids": json.dumps(list(rec.prompt_ids)),
        "sampling": json.dumps(sampling_to_dict(rec.sampling)),
        "priority": rec.priority,
        "tenant": rec.tenant,
        "state": rec.state.value,
        "owner": rec.owner,
        "attempt": rec.attempt,
        "prefill": rec.prefill,
        "decode": rec.decode,
        "finish_reason": rec.finish_reason or "",
        "status": rec.status.value,
        "error": rec.error,
        "choices": rec.choices,
        "predicted_tokens": rec.predicted_tokens,
        "tpot_slo_ms": rec.tpot_slo_ms,
        "created": now,
        "updated": now,
    }


class MalformedRecord(ValueError):
    """A record in Redis that does not parse (written by something else, or damaged)."""


def _record(request_id: str, h: dict, failures: list[str]) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        prompt_ids=tuple(json.loads(h.get("prompt_ids", "[]"))),
        sampling=sampling_from_dict(json.loads(h.get("sampling", "{}"))),
        priority=int(h.get("priority", 0)),
        tenant=h.get("tenant", ""),
        state=RecordState(h.get("state", "QUEUED")),
        owner=h.get("owner", ""),
        attempt=int(h.get("attempt", 0)),
        prefill=h.get("prefill", ""),
        decode=h.get("decode", ""),
        finish_reason=FinishReason(h["finish_reason"]) if h.get("finish_reason") else None,
        status=Status(h.get("status") or "OK"),
        error=h.get("error", ""),
        failures=tuple(failures),
        choices=int(h.get("choices", 1)),
        predicted_tokens=float(h.get("predicted_tokens", 0)),
        tpot_slo_ms=float(h.get("tpot_slo_ms", 0)),
    )


def _append_args(w: LogWrite, ttl_s: int, end: RequestRecord | None = None):
    """APPEND_SCRIPT's keys and arguments: a token write, and with `end`, the end."""
    rid = w.request_id
    keys = [key(rid), key(rid) + ":tokens", ACTIVE, key(rid) + ":failures"]
    if end is None:
        state = reason = error = ""
        status, failures = "OK", ()
        if w.finish_reason is not None:  # a decode worker's natural end
            state, reason = RecordState.FINISHED.value, w.finish_reason.value
    else:
        state, reason, error = end.state.value, end.finish_reason or "", end.error
        status, failures = end.status.value, end.failures
    args = [w.attempt, w.offset, ttl_s, state, reason, error, rid, str(time.time()), status]
    return keys, [*args, len(failures), *failures, *w.token_ids]


def _flat(d: dict) -> list:
    out: list = []
    for k, v in d.items():
        out += [k, v]
    return out


# A pooled connection idle for over this long is PINGed before use, and reconnected once if
# the PING fails: after a Redis restart, stale connections must not fail real commands. The
# commands themselves are never sent twice (retry_on_error stays empty).
_HEALTH_CHECK_S = 0.5


def _connection_options(timeout_s: float, connection: type) -> dict:
    """The options both store clients connect with.

    CLIENT SETINFO is turned off. redis-py (5.0 on) pipelines it in the connection handshake
    and reads the replies last; when the health check's interval has passed mid-handshake, its
    PING reads SETINFO's reply instead of PONG, and on a Redis older than 7.2, which answers
    SETINFO with an error, the whole connect fails ("unknown subcommand 'SETINFO'"): a
    request refused for a label that Tandem never reads."""
    params = inspect.signature(connection.__init__).parameters  # the client's own class
    no_setinfo = {"lib_name": None, "lib_version": None}  # redis-py before driver_info
    if "driver_info" in params:
        no_setinfo = {"driver_info": None}
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "decode_responses": True,
        "health_check_interval": _HEALTH_CHECK_S,
        **no_setinfo,
    }


class RedisStore:
    """The router's RequestStore, on redis-py's asyncio client."""

    def __init__(self, url: str, ttl_s: int = 3600, timeout_s: float = 5.0) -> None:
        self.url, self.ttl_s, self.timeout_s = url, ttl_s, timeout_s
        self.r = aioredis.Redis.from_url(
            url,
            retry=AsyncRetry(NoBackoff(), 1),
            **_connection_options(timeout_s, aioredis.connection.AbstractConnection),
        )
        self._append = self.r.register_script(APPEND_SCRIPT)
        self._begin = self.r.register_script(BEGIN_SCRIPT)
        self._create = self.r.register_script(CREATE_SCRIPT)
        self._claim = self.r.register_script(CLAIM_SCRIPT)
        self._lease = self.r.register_script(LEASE_SCRIPT)
        self._tenants = self.r.register_script(TENANTS_SCRIPT)
        self._raise = self.r.register_script(RAISE_SCRIPT)
        self._void = self.r.register_script(VOID_SCRIPT)

    @property
    def where(self) -> str:
        return redact(self.url)

    @_reachable
    async def ping(self) -> str:
        info = await self.r.info("server")
        return str(info.get("run_id", ""))

    @_reachable
    async def create(self, rec: RequestRecord, nonce: str = "") -> bool:
        rid = rec.request_id
        fields = _flat({**_fields(rec), "nonce": nonce})
        return bool(await self._create(keys=[key(rid), ACTIVE], args=[rid, *fields]))

    @_reachable
    async def void(self, rid: str, nonce: str, status: Status, error: str) -> bool:
        args = [rid, nonce, status.value, error, str(time.time()), self.ttl_s]
        return bool(await self._void(keys=[key(rid), ACTIVE], args=args))

    @_reachable
    async def restore(self, rec: RequestRecord, tokens: list[int]) -> None:
        rid = rec.request_id
        await self._create(keys=[key(rid), ACTIVE], args=[rid, *_flat(_fields(rec))])
        if rec.failures and not await self.r.exists(key(rid) + ":failures"):
            await self.r.rpush(key(rid) + ":failures", *rec.failures)
        if tokens:
            w = LogWrite(rid, rec.attempt, 0, tuple(tokens))
            await self._append(*_append_args(w, self.ttl_s))

    @_reachable
    async def begin_attempt(
        self, rid: str, attempt: int, owner: str, prefill: str, decode: str, failure: str
    ) -> BeginResult:
        res = await self._begin(
            keys=[key(rid), key(rid) + ":failures"],
            args=[attempt, owner, prefill, decode, failure, str(time.time())],
        )
        return BeginResult(res)

    @_reachable
    async def end(self, rec: RequestRecord, tokens: list[int]) -> None:
        # The store may have lost this attempt's beginning (a restart): catch it up first. A
        # newer attempt than ours means another router drives the request: leave it be.
        rid = rec.request_id
        await self._raise(keys=[key(rid)], args=[rec.attempt])
        w = LogWrite(rid, rec.attempt, 0, tuple(tokens))
        result, _ = await self._append(*_append_args(w, self.ttl_s, rec))
        if result == "missing":  # the store lost the record (a restart): end it whole anyway
            await self.restore(replace(rec, state=RecordState.RUNNING), [])
            await self._append(*_append_args(w, self.ttl_s, rec))

    @_reachable
    async def get(self, rid: str) -> RequestRecord | None:
        async with self.r.pipeline(transaction=False) as p:
            p.hgetall(key(rid))
            p.lrange(key(rid) + ":failures", 0, -1)
            h, failures = await p.execute()
        if not h:
            return None
        try:
            return _record(rid, h, failures)
        except (ValueError, TypeError, KeyError) as e:  # json's errors are ValueErrors
            raise MalformedRecord(f"request {rid}: its record in Redis is malformed: {e}") from e

    @_reachable
    async def tokens(self, rid: str, start: int = 0) -> list[int]:
        return [int(t) for t in await self.r.lrange(key(rid) + ":tokens", start, -1)]

    @_reachable
    async def active(self) -> list[str]:
        return sorted(await self.r.smembers(ACTIVE))

    @_reachable
    async def claim(self, rid: str, old_owner: str, new_owner: str) -> bool:
        return bool(await self._claim(keys=[key(rid)], args=[old_owner, new_owner]))

    @_reachable
    async def heartbeat(self, router_id: str, address: str, ttl_s: float) -> None:
        await self.r.set(f"{PREFIX}router:{router_id}", address, px=int(ttl_s * 1000))

    @_reachable
    async def live_routers(self) -> dict[str, str]:
        keys = [k async for k in self.r.scan_iter(match=f"{PREFIX}router:*", count=100)]
        if not keys:
            return {}
        values = await self.r.mget(keys)
        n = len(f"{PREFIX}router:")
        return {k[n:]: v for k, v in zip(keys, values) if v is not None}

    @_reachable
    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        return bool(
            await self._lease(keys=[f"{PREFIX}lease:{name}"], args=[holder, int(ttl_s * 1000)])
        )

    @_reachable
    async def lease_holder(self, name: str) -> str | None:
        return await self.r.get(f"{PREFIX}lease:{name}")

    @_reachable
    async def change_tenants(self, changes: dict[str, dict], resets: list[str]) -> int:
        keys = [TENANTS, TENANTS + ":version"]
        return int(await self._tenants(keys=keys, args=[json.dumps(resets), json.dumps(changes)]))

    @_reachable
    async def tenants_version(self) -> int:
        return int(await self.r.get(TENANTS + ":version") or 0)

    @_reachable
    async def tenants(self) -> tuple[int, dict[str, dict]]:
        async with self.r.pipeline(transaction=True) as p:
            p.get(TENANTS + ":version")
            p.hgetall(TENANTS)
            version, entries = await p.execute()
        overrides = {}
        for tenant, text in entries.items():
            try:
                overrides[tenant] = json.loads(text)
            except ValueError:  # left for the table to refuse, naming the tenant
                overrides[tenant] = text
        return int(version or 0), overrides

    @_reachable
    async def put_json(self, name: str, value: dict) -> None:
        await self.r.set(f"{PREFIX}{name}", json.dumps(value))

    @_reachable
    async def get_json(self, name: str) -> dict | None:
        v = await self.r.get(f"{PREFIX}{name}")
        return json.loads(v) if v else None

    def token_log(self) -> RedisTokenLog:
        return RedisTokenLog(self.url, self.ttl_s, self.timeout_s)

    async def close(self) -> None:
        await self.r.aclose()


class RedisTokenLog:
    """The decode workers' TokenLog: one pipelined round trip per write batch. Picklable
    (it connects on first use), so it is handed to workers as a constructor argument."""

    def __init__(self, url: str, ttl_s: int = 3600, timeout_s: float = 5.0) -> None:
        self.url, self.ttl_s, self.timeout_s = url, ttl_s, timeout_s
        self._r: redis.Redis | None = None

    def __getstate__(self) -> dict:
        return {"url": self.url, "ttl_s": self.ttl_s, "timeout_s": self.timeout_s, "_r": None}

    def _client(self) -> redis.Redis:
        if self._r is None:
            self._r = redis.Redis.from_url(
                self.url,
                retry=Retry(NoBackoff(), 1),
                **_connection_options(self.timeout_s, redis.connection.AbstractConnection),
            )
            self._script = self._r.register_script(APPEND_SCRIPT)
        return self._r

    def write(self, writes: list[LogWrite]) -> list[LogAck]:
        r = self._client()
        try:
            with r.pipeline(transaction=False) as p:
                for w in writes:
                    keys, args = _append_args(w, self.ttl_s)
                    self._script(keys=keys, args=args, client=p)
                results = p.execute()
        except (redis.RedisError, OSError) as e:
            _raise_as_away(e)
        return [
            LogAck(w.request_id, LogResult(res), int(n)) for w, (res, n) in zip(writes, results)
        ]
