"""Who may call the router: API keys, each held only as the SHA-256 of its text, each with the
tenant its requests belong to and the scopes it may use.

    keys:
      - {sha256: 9f86d0...0f00a08, tenant: acme, scopes: [generate]}
      - {sha256: 2c26b4...5f5c2ae, tenant: ops, scopes: [generate, admin]}

`tandem keys hash` prints a key's line. `router.auth_token` is a shortcut for one key with
every scope, of the tenant `default`. A presented key is hashed and compared with every
entry in constant time (hmac.compare_digest, no early exit), so the time taken says nothing
of which keys exist or how close a guess came.

Scopes: `generate` (Generate, Resume, Cancel), `admin` (Scale, Drain). Status takes any valid
key; health checks and reflection take none.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from router.config import RouterConfig

SCOPES = ("generate", "admin")
AUTH_TOKEN_ENV = "TANDEM_AUTH_TOKEN"  # the router's auth_token, kept off its command line
DEFAULT_TENANT = "default"
TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # no "/": it joins a tenant to its request ids
_HEX = re.compile(r"[0-9a-f]{64}")


def key_hash(key: str) -> str:
    """The SHA-256 of a key's text, in hex: all a key file holds of it."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who a valid key says the caller is."""

    tenant: str
    scopes: frozenset[str]

    def may(self, scope: str) -> bool:
        return scope in self.scopes


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    principal: Principal


class KeyFileError(ValueError):
    """A key file that cannot be used, naming the entry and field at fault."""


class KeyRing:
    """The keys a router takes. Immutable once built; safe from any thread or task."""

    def __init__(self, entries: list[tuple[str, str, tuple[str, ...]]]) -> None:
        """entries: (sha256 hex, tenant, scopes) each, already checked."""
        self._entries = tuple(
            _Entry(bytes.fromhex(h), Principal(t, frozenset(s))) for h, t, s in entries
        )
        if not self._entries:
            raise KeyFileError("the key file lists no keys: a router with auth needs one")

    @classmethod
    def build(cls, keys_file: str | None, auth_token: str | None) -> KeyRing | None:
        """The ring from a key file and the single-token shortcut; None when neither is
        given (the router is open)."""
        if not keys_file and not auth_token:
            return None
        entries = read_key_file(Path(keys_file)) if keys_file else []
        if auth_token:
            entries.append((key_hash(auth_token), DEFAULT_TENANT, SCOPES))
        return cls(entries)  # a key file of no keys is refused, never an open router

    def principal(self, presented: str | None) -> Principal | None:
        """Who `presented` (a key's text) belongs to; None for no key or a wrong one."""
        if not presented:
            return None
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for entry in self._entries:  # every entry, always: no early exit
            if hmac.compare_digest(digest, entry.digest):
                found = entry.principal
        return found

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(e.principal.tenant for e in self._entries)


def router_keys(cfg: RouterConfig) -> KeyRing | None:
    """The keys a router with this config takes: its key file and its auth_token (or the
    TANDEM_AUTH_TOKEN environment variable); None when it has neither (an open router)."""
    return KeyRing.build(cfg.api_keys_file, cfg.auth_token or os.environ.get(AUTH_TOKEN_ENV))


def read_key_file(path: Path) -> list[tuple[str, str, tuple[str, ...]]]:
    """(sha256, tenant, scopes) of each key in a key file; KeyFileError naming what is wrong."""
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise KeyFileError(f"key file {path}: cannot read it: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise KeyFileError(f"key file {path}: not YAML: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise KeyFileError(f"key file {path}: expected 'keys:' with a list of entries")
    out, seen = [], set()
    for i, entry in enumerate(doc["keys"]):
        where = f"key file {path}: keys[{i}]"
        if not isinstance(entry, dict):
            raise KeyFileError(f"{where}: expected {{sha256, tenant, scopes}}")
        unknown = sorted(set(entry) - {"sha256", "tenant", "scopes"})
        if unknown:
            hint = " (a key's text never goes in the file: `tandem keys hash`)"
            raise KeyFileError(f"{where}: unknown field(s) {unknown}{hint}")
        digest = str(entry.get("sha256", "")).lower()
        if not _HEX.fullmatch(digest):
            raise KeyFileError(
                f"{where}.sha256: expected 64 hex digits, the SHA-256 of the key "
                "(`tandem keys hash` prints it)"
            )
        if digest in seen:
            raise KeyFileError(f"{where}.sha256: the same key is listed twice")
        seen.add(digest)
        tenant = entry.get("tenant")
        if not isinstance(tenant, str) or not TENANT.fullmatch(tenant):
            raise KeyFileError(f"{where}.tenant: 1-64 characters from letters, digits and . _ -")
        scopes = entry.get("scopes")
        if not isinstance(scopes, list) or not scopes or any(s not in SCOPES for s in scopes):
            raise KeyFileError(f"{where}.scopes: a non-empty list from {', '.join(SCOPES)}")
        out.append((digest, tenant, tuple(scopes)))
    return out
