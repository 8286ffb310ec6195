"""`tandem generate --address`, `tandem status`, `tandem scale`, `tandem drain` and `tandem
tenants`: clients of a running cluster."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

API_KEY_ENV = "TANDEM_API_KEY"


def add_client_flags(p: argparse.ArgumentParser) -> None:
    """How a client command reaches a router: its API key, and TLS."""
    p.add_argument(
        "--api-key-file",
        help=f"a file holding the API key (default: the {API_KEY_ENV} environment variable)",
    )
    p.add_argument("--token", help=f"the API key itself (shows in ps: prefer {API_KEY_ENV})")
    p.add_argument("--tls-ca", help="reach the router over TLS, trusting this PEM CA")
    p.add_argument("--tls-cert", help="PEM certificate to present (a router with a client CA)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")


def client_tls(args: argparse.Namespace):
    """The TLS a client command asked for (None: plaintext)."""
    from router.edge.tls import ClientTLS, TLSFileError

    try:
        return ClientTLS.of(args.tls_ca, args.tls_cert, args.tls_key)
    except TLSFileError as e:
        raise SystemExit(f"tandem: {e}") from None


def client_key(args: argparse.Namespace) -> str | None:
    """The key a client command sends: --token, --api-key-file, else TANDEM_API_KEY."""
    if args.token:
        return args.token
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                return f.read().strip() or None
        except OSError as e:
            raise SystemExit(f"tandem: cannot read --api-key-file: {e.strerror or e}") from None
    return os.environ.get(API_KEY_ENV) or None


async def generate_remote(args: argparse.Namespace, requests) -> int:
    from client import TandemClient, to_proto

    client = TandemClient(args.address, client_key(args), client_tls(args))
    sem = asyncio.Semaphore(max(1, args.concurrency))
    results: dict[int, object] = {}
    printed = 0

    async def one(i, req):
        async with sem:
            results[i] = await client.generate_choices(to_proto(req), timeout_s=args.timeout)

    def flush() -> None:
        nonlocal printed
        while printed in results:
            choices = results[printed]
            for r in choices:
                if args.json:
                    print(json.dumps(r.completion(printed).to_json()), flush=True)
                    continue
                if len(requests) > 1 or len(choices) > 1:
                    which = f", choice {r.index}" if len(choices) > 1 else ""
                    print(f"=== request {printed}{which} ===")
                print(r.text if r.status == "OK" else f"[{r.status}] {r.error}", flush=True)
            printed += 1

    try:
        tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(requests)]
        for t in asyncio.as_completed(tasks):
            await t
            flush()
    finally:
        await client.close()
    bad = [
        r for rs in results.values() for r in rs if r.status != "OK" or r.finish_reason == "error"
    ]
    for r in bad:
        print(
            f"tandem generate: {r.request_id or 'request'}: {r.status}: {r.error}", file=sys.stderr
        )
    return 1 if bad else 0


def cmd_status(args: argparse.Namespace) -> int:
    return asyncio.run(_status(args))


def cmd_scale(args: argparse.Namespace) -> int:
    return asyncio.run(_scale(args))


def cmd_drain(args: argparse.Namespace) -> int:
    return asyncio.run(_drain(args))


async def _admin(args, what: str, calls) -> int:
    """Run admin calls (each a (label, coroutine factory) pair, in order) with progress on
    stderr, then print their outcome and the cluster's status, as a table or as JSON."""
    import grpc

    from client import TandemClient, status_to_dict

    client = TandemClient(args.address, client_key(args), client_tls(args))
    done = {}
    try:
        for label, call in calls:
            print(f"[tandem {what}] {label}...", file=sys.stderr, flush=True)
            done[label] = await call(client.admin)
        status = status_to_dict(await client.status())
    except grpc.aio.AioRpcError as e:
        print(f"tandem {what}: {args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        await client.close()
    if args.json:
        print(json.dumps({what: done, "status": status}))
    else:
        for label, outcome in done.items():
            print(f"{label}: {outcome}")
        print_status(status)
    return 0


async def _scale(args) -> int:
    from router.api import tandem_pb2 as pb

    sizes = [
        (pool, n)
        for pool, n in (("prefill", args.prefill), ("decode", args.decode))
        if n is not None
    ]
    if not sizes:
        print("tandem scale: give --prefill N and/or --decode N", file=sys.stderr)
        return 2

    def scale(pool: str, n: int):
        async def call(admin) -> list[str]:
            request = pb.ScaleRequest(pool=pool, replicas=n)
            return list((await admin.Scale(request, timeout=args.timeout)).workers)

        return f"{pool} to {n}", call

    return await _admin(args, "scale", [scale(pool, n) for pool, n in sizes])


async def _drain(args) -> int:
    from router.api import tandem_pb2 as pb

    async def call(admin) -> dict:
        request = pb.DrainRequest(worker=args.worker, timeout_s=args.drain_timeout)
        r = await admin.Drain(request, timeout=args.drain_timeout + 60)
        return {"drained": r.drained, "message": r.message}

    return await _admin(args, "drain", [(f"drain {args.worker}", call)])


def cmd_tenants(args: argparse.Namespace) -> int:
    return asyncio.run(_tenants(args))


def tenant_request(sets: list[tuple[str, str]], resets: list[str] = ()):
    """A TenantsRequest from --set TENANT FIELD=VALUE,... pairs ('none' unsets max_wait_s)
    and --reset TENANT names."""
    from router.api import tandem_pb2 as pb
    from router.tenant_policy import POLICY_TYPES as TENANT_FIELDS

    request = pb.TenantsRequest(reset=resets)
    for name, fields in sets:
        p = request.set.add(name=name)
        for item in filter(None, (f.strip() for f in fields.split(","))):
            field, sep, value = item.partition("=")
            if not sep or field not in TENANT_FIELDS:
                raise ValueError(
                    f"{item!r}: give FIELD=VALUE, FIELD one of {', '.join(TENANT_FIELDS)}"
                )
            if value.lower() == "none":
                if field != "max_wait_s":
                    raise ValueError(f"{field}: only max_wait_s may be none")
                value = "0"
            try:
                setattr(p, field, TENANT_FIELDS[field](value))
            except ValueError:
                raise ValueError(f"{item!r}: {field} takes a number") from None
    return request


async def _tenants(args) -> int:
    import grpc

    from client import TandemClient, tenants_to_dict

    try:
        request = tenant_request(args.set, args.reset)
    except ValueError as e:
        print(f"tandem tenants: --set {e}", file=sys.stderr)
        return 2
    client = TandemClient(args.address, client_key(args), client_tls(args))
    try:
        reply = await client.admin.Tenants(request, timeout=30)
    except grpc.aio.AioRpcError as e:
        print(f"tandem tenants: {args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        await client.close()
    tenants = tenants_to_dict(reply.tenants)
    error = reply.length_error_tokens
    if args.json:
        print(json.dumps({"tenants": tenants, "length_error_tokens": error}))
    else:
        print_tenants(tenants)
        if error >= 0:
            print(f"output-length prediction: mean absolute error {error:.1f} tokens")
    return 0


def kv_width(w: dict) -> str:
    """A worker's KV bytes per token, as ` (N KiB/token)`; empty from a router that does not
    say."""
    per_token = w.get("kv_bytes_per_token") or 0
    return f" ({per_token / 1024:g} KiB/token)" if per_token else ""


def print_tenants(tenants: list[dict]) -> None:
    for t in tenants:
        quota = "none" if t["tokens_per_minute"] == 0 else f"{t['tokens_per_minute']:.0f}/min"
        left = "" if t["quota_left"] is None else f" ({t['quota_left']:.0f} left)"
        cap = t["max_concurrency"] or "-"
        wait = f"{t['max_wait_s']:g}s" if t["max_wait_s"] else "-"
        print(
            f"tenant {t['name']:<12} tier={t['tier']} weight={t['weight']:g} "
            f"max_concurrency={cap} quota={quota}{left} max_wait={wait} "
            f"running={t['running']} waiting={t['waiting']} served={t['served']:.0f}"
        )


async def _status(args) -> int:
    import grpc

    from client import fetch_status

    try:
        s = await fetch_status(args.address, client_key(args), client_tls(args))
    except grpc.aio.AioRpcError as e:
        print(f"tandem status: {args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(s))
        return 0
    print_status(s)
    return 0


def print_status(s: dict) -> None:
    r = s["router"]
    print(
        f"router {r['router_id']}{' (controller)' if r['controller'] else ''}: "
        f"mode={r['mode']} queue_depth={r['queue_depth']} in_flight={r['in_flight']} "
        f"store={'ok' if r['store_available'] else 'UNREACHABLE'}"
    )
    print(
        f"replays: {r['replays_in_flight']} in flight, {r['replays_total']} started, "
        f"{r['replays_recovered']} recovered (failure to next token p50 "
        f"{r['recovery_p50_s']:.2f} s, max {r['recovery_max_s']:.2f} s)"
    )
    for pool, p in s["pools"].items():
        starting = f", {p['starting']} starting" if p["starting"] else ""
        print(f"{pool} pool: {p['live']}/{p['target']} live{starting}, {p['restarts']} restarts")
        if p.get("autoscale"):
            print(f"  autoscale: {p['autoscale']}")
    print_tenants(s.get("tenants", []))
    rows = [w for pool in ("prefill", "decode") for w in s[pool]]
    states = []
    for w in rows:
        state = "alive" if w["alive"] else "DEAD"
        silent = w.get("unresponsive_s", 0)
        if w["alive"] and silent:  # its figures are its last answer's
            state = f"UNRESPONSIVE {silent:.0f}s"
        states.append(state)
    width = max((len(st) for st in states), default=5)
    for w, state in zip(rows, states):
        print(
            f"{w['name']:<12} {state:<{width}} pid={w['pid']:<7} "
            f"node={w['node']:<15} kv={w['kv_blocks_free']}/{w['kv_blocks_total']}"
            f"{kv_width(w)} "
            + (f"ranks={','.join(map(str, w['rank_pids']))} " if w.get("rank_pids") else "")
            + f"running={w['running']} waiting={w['waiting']}"
            f"{' draining' if w['draining'] else ''}"
        )
