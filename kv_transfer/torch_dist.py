"""The torch.distributed channel: a two-rank process group per prefill-decode pair, gloo for
CPU tensors and NCCL for CUDA tensors, formed lazily through a TCPStore rendezvous.

There is no global init_process_group: pools change size, so each pair builds its own group
on first use. The decode worker hosts one TCPStore; each pair, and each rebuild of it, takes a
fresh key prefix (`pair/<prefill>/<generation>`), so a rebuilt group never meets a stale one.
Every rendezvous, send and recv has a timeout; a group that failed once is shut down and
replaced by the next generation.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from kv_transfer.channel import KVChannel
from kv_transfer.protocol import TransferError

log = logging.getLogger(__name__)


def store_server(host: str) -> dist.TCPStore:
    """The decode worker's rendezvous store, on an ephemeral port (read `.port`)."""
    return dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except Exception as e:
        raise TransferError(f"cannot reach the KV rendezvous store at {host}:{port}: {e}") from e


class PairGroup(KVChannel):
    """Rank 0 is the prefill worker, rank 1 the decode worker."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        device: torch.device,
        bind_host: str,
        timeout_s: float,
    ) -> None:
        self.prefix, self.rank, self.device = prefix, rank, device
        self.peer = 1 - rank
        self._closed = False
        timeout = datetime.timedelta(seconds=timeout_s)
        pstore = dist.PrefixStore(prefix, store)
        try:
            if device.type == "cuda":
                self.pg = _nccl_group(pstore, rank, timeout)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
                self.pg = dist.ProcessGroupGloo(pstore, rank, 2, opts)
        except Exception as e:
            raise TransferError(
                f"pair group {prefix} did not form within {timeout_s:.0f} s: {e}"
            ) from e

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def post_send(self, tensor):
        return self._post(lambda: self.pg.send([tensor], self.peer, 0), "send")

    def post_recv(self, tensor):
        return self._post(lambda: self.pg.recv([tensor], self.peer, 0), "recv")

    def wait(self, handle, timeout_s):
        try:
            if not handle.wait(datetime.timedelta(seconds=timeout_s)):
                raise TimeoutError("did not complete")
        except Exception as e:
            self.close()
            raise TransferError(f"transfer on pair {self.prefix} failed: {e}") from e

    def settle(self, handles, timeout_s):
        """Closing a gloo group does not cancel its posted receives: a peer still sending
        completes them. Each is waited for here: it lands, or its wait fails, and a failed
        wait (a timeout included) breaks the connection, after which nothing lands at all."""
        for h in handles:
            try:
                h.wait(datetime.timedelta(seconds=timeout_s))
            except Exception:  # over: the connection is gone
                log.debug("pair %s: an abandoned receive ended", self.prefix, exc_info=True)

    def _post(self, fn, what: str):
        if self._closed:
            raise TransferError(f"pair group {self.prefix} is closed")
        try:
            return fn()
        except Exception as e:
            self.close()
            raise TransferError(f"{what} on pair {self.prefix} failed: {e}") from e

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            self.pg.abort() if hasattr(self.pg, "abort") else None
        except Exception:  # the group is being dropped either way
            log.debug("abort of pair group %s raised", self.prefix, exc_info=True)
        self.pg = None  # receives already posted may still complete: see settle


def _nccl_group(store, rank: int, timeout: datetime.timedelta):
    if not dist.is_nccl_available():
        raise TransferError("CUDA KV transfer needs NCCL, which this torch build lacks")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, opts)
