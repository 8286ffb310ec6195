"""All-reduce and all-gather through shared memory, for the CPU ranks of one worker.

gloo over loopback takes 0.7 to 1.4 ms per all-reduce of a decode step's few rows (measured
on a 2-core AMD EPYC), and a step makes two per layer: 60 for SmolLM2, most of a step. Ranks on
one node can instead write their parts into one shared mapping and read each other's: a few
microseconds plus the copy. Each rank has a slot in each of two buffers; an exchange writes the
rank's part into its slot of buffer `n % 2`, publishes `n` in its own flag, waits until every
flag reaches `n`, and reads all the slots. Two buffers suffice: a rank writes buffer `n % 2`
again only at `n + 2`, after every other rank has published `n + 1`, which each does only once
it has read `n`.

Every rank sums the parts in rank order, so all ranks hold the same bits. A part bigger than
a slot goes through in pieces, by the same rule on every rank. Ordering: on x86 (TSO) a store
is never seen before an earlier store, nor a load done before an earlier load, so a flag seen
means its data is seen; elsewhere the ranks keep gloo (`shm_available`).

A wait past `timeout_s` raises (a rank that hung or died), as gloo's would.
"""

from __future__ import annotations

import mmap
import os
import platform
import time

import torch

from workers.model.tensor_parallel import Collectives

FLAG_STRIDE = 8  # int64s per flag: one 64-byte line each, so ranks do not share a line
SLOT_BYTES = 8 << 20  # per rank and buffer


def shm_available() -> str | None:
    """None where shared-memory collectives are correct here, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} orders memory more weakly than x86's TSO"
    if not os.path.isdir("/dev/shm"):
        return "no /dev/shm"
    return None


def shm_bytes(size: int) -> int:
    return size * FLAG_STRIDE * 8 + 2 * size * SLOT_BYTES


def create_segment(name: str, size: int) -> str:
    """Rank 0: a zeroed file in /dev/shm for `size` ranks, its pages reserved now (OSError
    where the tmpfs cannot hold it, rather than a SIGBUS at first touch); its path."""
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, shm_bytes(size))
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


class ShmCollectives(Collectives):
    """`Collectives` over a /dev/shm mapping that every rank has opened (`create_segment`;
    rank 0 unlinks the file once all have, so nothing is left behind by a crash)."""

    def __init__(self, path: str, rank: int, size: int, timeout_s: float, peers_alive=None) -> None:
        """`peers_alive()`: False once a rank this one may wait for is known dead (asked a
        few times a second while waiting), which ends the wait at once."""
        super().__init__(None, size)
        self.rank, self.timeout_s, self.peers_alive = rank, timeout_s, peers_alive
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, shm_bytes(size))
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        head = size * FLAG_STRIDE * 8
        self.flags = raw[:head].view(torch.int64).view(size, FLAG_STRIDE)[:, 0]
        self.slots = raw[head:].view(2, size, SLOT_BYTES)
        self.count = 0  # exchanges made; the flags count them too

    def _exchange(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `part` (same shape and dtype on all), as views of the slots: valid
        until this rank's next exchange (read them before it)."""
        self.count += 1
        n = self.count
        nbytes = part.numel() * part.element_size()
        buf = self.slots[n % 2]
        buf[self.rank, :nbytes].view(part.dtype).view(part.shape).copy_(part)
        self.flags[self.rank] = n
        self._wait(n)
        return [buf[r, :nbytes].view(part.dtype).view(part.shape) for r in range(self.size)]

    def _wait(self, n: int) -> None:
        flags, spins, deadline, checked = self.flags, 0, None, 0.0
        while int(flags.min()) < n:
            spins += 1
            if spins % 64:
                continue
            os.sched_yield()  # more ranks than cores: let the one we wait for run
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now > deadline:
                raise TimeoutError(
                    f"tp rank {self.rank}: ranks {self._behind(n)} did not reach "
                    f"collective {n} within {self.timeout_s:.0f} s"
                )
            if self.peers_alive is not None and now - checked > 0.2:
                checked = now
                if not self.peers_alive():
                    raise RuntimeError(
                        f"tp rank {self.rank}: a rank died (ranks {self._behind(n)} never "
                        f"reached collective {n})"
                    )

    def _behind(self, n: int) -> list[int]:
        return [r for r in range(self.size) if int(self.flags[r]) < n]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return t
        flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        per = SLOT_BYTES // flat.element_size()
        for start in range(0, flat.numel(), per):
            piece = flat[start : start + per]
            parts = self._exchange(piece)
            torch.add(parts[0], parts[1], out=piece)
            for p in parts[2:]:
                piece.add_(p)
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat.view(t.shape))
        return t

    def broadcast_first(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            t.copy_(self._exchange(t.contiguous())[0])
        return t

    def all_gather_columns(self, t: torch.Tensor, width: int) -> torch.Tensor:
        if self.size == 1:
            return t
        chunk = -(-width // self.size)
        rows = t.shape[0]
        out = torch.empty(rows, chunk * self.size, dtype=t.dtype)
        step = max(1, SLOT_BYTES // (chunk * t.element_size()))
        for start in range(0, rows, step):
            piece = t[start : start + step]
            if piece.shape[-1] != chunk:
                piece = torch.nn.functional.pad(piece, (0, chunk - piece.shape[-1]))
            for r, part in enumerate(self._exchange(piece.contiguous())):
                out[start : start + step, r * chunk : (r + 1) * chunk] = part
        return out[:, :width]

    def close(self) -> None:
        self.flags = self.slots = None
        self._map.close()
