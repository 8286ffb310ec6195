"""A step's host-device traffic: one copy in, one copy out.

`StepInputs` packs every column a step sends to the device (token ids, positions, slots,
block tables, context lengths, the sampled rows, the sampling parameters and draws) into one
host buffer, pinned when the device is a GPU, and sends it in one non-blocking copy; each
column is then a view of the device buffer. `fetch` packs what the step brings back (token
ids, logprobs, top alternatives) into one device tensor and copies it to pinned host memory
without blocking, behind an event the caller waits on only when it needs the values.

Building a tensor from a Python list on the device (`torch.tensor(list, device=cuda)`) copies
from pageable memory and waits for the stream: a dozen of them a step cost milliseconds of
host time at batch 1. The pinned buffers come from torch's caching host allocator, which
keeps a block from reuse until the copies recorded on it have run. On the CPU, the host
buffer is the device buffer: no copy at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bool: np.bool_,
}
# Columns start 16 bytes apart: Triton compiles a kernel apart for pointers that are not
# 16-byte aligned, and a step's layout must not pick which one runs (a compile mid-serving).
_ALIGN = 16


class StepInputs:
    """Columns added one by one (`add`, which returns the column's index), then sent together
    (`send`): each is a device tensor of the values it was given, shape kept."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._columns: list[tuple[np.ndarray, torch.dtype]] = []

    def add(self, values: Sequence | np.ndarray, dtype: torch.dtype = torch.int64) -> int:
        """Queue one column (a list, nested lists of equal width, or an array)."""
        self._columns.append((np.asarray(values, dtype=_NUMPY[dtype]), dtype))
        return len(self._columns) - 1

    def send(self) -> list[torch.Tensor]:
        """All columns on the device, in the order added, from one copy."""
        offsets, total = [], 0
        for arr, _ in self._columns:
            offsets.append(total)
            total += -(-arr.nbytes // _ALIGN) * _ALIGN
        pinned = self.device.type == "cuda"
        host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pinned)
        flat = host.numpy()
        for (arr, _), off in zip(self._columns, offsets):
            flat[off : off + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        dev = host.to(self.device, non_blocking=True) if pinned else host
        self._columns, columns = [], self._columns
        return [
            dev[off : off + arr.nbytes].view(dtype).view(arr.shape)
            for (arr, dtype), off in zip(columns, offsets)
        ]


@dataclass
class Fetched:
    """Columns on their way to the host; `wait` returns them as NumPy arrays."""

    host: torch.Tensor  # [N, total] float64, pinned on a GPU
    widths: list[int]
    event: torch.cuda.Event | None

    def wait(self) -> list[np.ndarray]:
        if self.event is not None:
            self.event.synchronize()
        packed, out, at = self.host.numpy(), [], 0
        for w in self.widths:
            out.append(packed[:, at : at + w])
            at += w
        return out


def fetch(columns: Sequence[torch.Tensor]) -> Fetched:
    """Row-aligned device columns ([N] or [N, k]) to the host in one copy, as float64 (exact
    for token ids and float32 values alike); nothing waits until `Fetched.wait`."""
    parts = [c.reshape(c.shape[0], -1).to(torch.float64) for c in columns]
    packed = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    widths = [p.shape[1] for p in parts]
    if packed.device.type != "cuda":
        return Fetched(packed, widths, None)
    host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return Fetched(host, widths, event)
