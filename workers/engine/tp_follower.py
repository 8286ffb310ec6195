"""A follower rank of a tensor-parallel engine (tp_ranks.py), as its own process:
`python -m workers.engine.tp_follower RANK`, its `RankSettings` pickled on stdin."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time

import torch

from kv_transfer.torch_dist import store_client
from workers.engine.model_runner import ModelRunner
from workers.engine.tp_ranks import HOST, LOAD_TIMEOUT_S, RankLink, RankSettings, rank_device
from workers.model.loader import build_model, resolve_model


def follow(settings: RankSettings, rank: int) -> None:
    """A follower rank's process: load its part, meet the others, then run each step rank 0
    sends until told to close (or until rank 0 is gone)."""
    config = settings.config
    threading.Thread(target=_orphaned, args=(settings.parent,), daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {rank}] %(message)s")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    store = store_client(HOST, settings.port, LOAD_TIMEOUT_S)
    device = rank_device(config, rank)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = build_model(
            resolve_model(config.model),
            getattr(torch, config.dtype),
            device,
            quantization=config.quantization,
            tp=(rank, settings.size),
        )
    except Exception as e:
        store.set(f"failed/{rank}", f"{type(e).__name__}: {e}")
        return
    store.set(f"ready/{rank}", b"1")
    pids = [int(p) for p in store.get("pids").decode().split(",")]
    link = RankLink(
        store,
        rank,
        settings.size,
        device,
        settings.step_timeout_s,
        settings.shm,
        lambda: os.getppid() == settings.parent and all(map(_runs, pids)),
    )
    runner = None
    prev = None
    while True:
        message = link.receive()
        op = message[0]
        if op == "close":
            return
        try:
            if op == "init":
                runner = ModelRunner(model, device=link.device, ranks=link, **message[1])
                link.barrier()  # rank 0 waits for every rank's runner here
            elif op == "launch":
                prev = runner.launch(message[1], prev=prev)
            elif op == "prompt_logits":
                runner.prompt_logits(*message[1:])
            else:
                raise RuntimeError(f"unknown message {op!r}")
        except Exception:  # out of step with rank 0 from here on: gone, rank 0 sees it
            logging.getLogger(__name__).exception("tp rank %d: %s failed; exiting", rank, op)
            sys.exit(1)


def _orphaned(parent: int) -> None:
    """Exit once rank 0 is gone, whatever the main thread is doing (a rank stuck outside a
    collective would otherwise outlive its worker, holding its memory or GPU)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _runs(pid: int) -> bool:
    """Whether process `pid` still runs (a rank's sibling; not a zombie's parent's child)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


if __name__ == "__main__":  # a follower rank: its settings come on stdin (`Followers`)
    follow(pickle.loads(bytes.fromhex(sys.stdin.readline())), int(sys.argv[1]))
