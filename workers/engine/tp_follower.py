"""A follower rank of a tensor-parallel engine (tp_ranks.py), as its own process:
`python -m workers.engine.tp_follower RANK`, its `RankSettings` pickled on stdin."""

from __future__ import annotations

import logging
import os
import pickle
import sys

import torch

from kv_transfer.torch_dist import store_client
from workers.engine.model_runner import ModelRunner
from workers.engine.tp_ranks import HOST, LOAD_TIMEOUT_S, RankLink, RankSettings, rank_device
from workers.model.loader import build_model, resolve_model


def follow(settings: RankSettings, rank: int) -> None:
    """A follower rank's process: load its part, meet the others, then run each step rank 0
    sends until told to close (or until rank 0 is gone)."""
    config = settings.config
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
    link = RankLink(
        store,
        rank,
        settings.size,
        device,
        settings.step_timeout_s,
        settings.shm,
        lambda: os.getppid() == settings.parent,
    )
    model.use_collectives(link.collectives)
    runner = None
    prev = None
    while True:
        message = link.receive()
        op = message[0]
        if op == "close":
            return
        if op == "init":
            runner = ModelRunner(model, device=link.device, ranks=link, **message[1])
        elif op == "launch":
            prev = runner.launch(message[1], prev=prev)
        elif op == "prompt_logits":
            runner.prompt_logits(*message[1:])
        else:
            raise RuntimeError(f"tp rank {rank}: unknown message {op!r}")


if __name__ == "__main__":  # a follower rank: its settings come on stdin (`Followers`)
    follow(pickle.loads(bytes.fromhex(sys.stdin.readline())), int(sys.argv[1]))
