"""An embedded redis-server on loopback, with AOF (appendfsync everysec) in the data folder,
for clusters started without --redis-url. A watchdog restarts it, on the same port and from
the same AOF, if it dies: the cluster's records survive the restart (what the last second of
writes may have lost, the routers and decode workers write again)."""

from __future__ import annotations

import atexit
import logging
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

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
        logfile = open(self.data_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [
                binary,
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
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
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
