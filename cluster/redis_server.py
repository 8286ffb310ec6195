"""An embedded redis-server on loopback, with AOF (appendfsync everysec) in the data folder,
for clusters started without --redis-url. A watchdog restarts it, on the same port and from
the same AOF, if it dies: the cluster's records survive the restart (what the last second of
writes may have lost, the routers and decode workers write again).

It is closed to other local users: a generated password (`requirepass`, given in a config
file of mode 0600, never on the command line where `ps` shows it), and a data folder of mode
0700 around the AOF, which holds every prompt and output. The URL with its password is kept
in `url` in that folder, for a router that joins (`TANDEM_REDIS_URL="$(cat F)" tandem router
...`: an environment variable, which ps does not show)."""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import redis

log = logging.getLogger(__name__)


class RedisServerError(RuntimeError):
    pass


def _private_write(path: Path, text: str) -> None:
    """Write a file only its owner may read, created so (never readable in between)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file of wider mode keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.password = secrets.token_urlsafe(24)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Its URL, password included: keep it out of logs (cluster.state.redact)."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def url_file(self) -> Path:
        return self.data_dir / "url"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self._launch(timeout_s)
        atexit.register(self.stop)  # never leave a server behind, whatever ends this process
        self._watchdog = threading.Thread(target=self._watch, name="redis-watchdog", daemon=True)
        self._watchdog.start()
        return self

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            if self.proc is not None and self.proc.poll() is not None:
                code = self.proc.returncode
                log.warning(
                    "embedded redis-server exited with %s; restarting it from its AOF", code
                )
                try:
                    self._launch(30.0)
                    self.restarts += 1
                    log.warning("embedded redis-server is back on port %d", self.port)
                except RedisServerError as e:
                    log.error("could not restart redis-server: %s", e)
                    self._stopping.wait(1.0)

    def _launch(self, timeout_s: float) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerError(
                "redis-server is not installed (apt-get install redis-server), "
                "or pass --redis-url to use a running Redis"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        conf = self.data_dir / "redis.conf"
        _private_write(conf, f"requirepass {self.password}\n")
        _private_write(self.url_file, self.url + "\n")
        logfile = open(self.data_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [
                binary,
                str(conf),
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.data_dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--protected-mode",
                "yes",
            ],
            stdout=logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        client = redis.Redis(
            port=self.port, password=self.password, socket_timeout=1, socket_connect_timeout=1
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisServerError(
                    f"redis-server exited with {self.proc.returncode}; "
                    f"see {self.data_dir / 'redis.log'}"
                )
            try:
                if client.ping():
                    return
            except (redis.ConnectionError, redis.BusyLoadingError):
                time.sleep(0.05)
        self.proc.kill()
        raise RedisServerError(f"redis-server did not answer on port {self.port} in {timeout_s} s")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stop(self) -> None:
        self._stopping.set()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
