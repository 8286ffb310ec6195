"""Reads a Hugging Face checkpoint folder: config.json plus one or more *.safetensors files,
streamed one tensor at a time.

safetensors hands out tensors that are views of a mapping of the whole file, and every page a
read touches stays in the process's resident memory while that mapping lives. Each tensor is
therefore read through a handle of its own, closed once the tensor is taken: the mapping (and
its resident pages) goes with the tensor, and reading a checkpoint never holds more than one.

Tensors are always read to the host, never with safetensors' `device="cuda"`: that path (0.8)
stages each tensor in pinned memory from torch's caching host allocator, which keeps its blocks
page-locked for the life of the process (a block per size class, each rounded up to a power of
two: the largest tensor's alone may take nearly twice its size). The model's own copy
(`load_hf_weights`) moves each tensor over instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from workers.model.config import CheckpointError, ModelConfig


def read_hf_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing (a model folder needs config.json)")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from e
    return ModelConfig.from_hf(raw, source=str(config_path))


def open_hf_folder(folder: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The config, and a lazy stream of (HF name, host tensor) in the checkpoint's own dtype.
    Every file's header is read here, so a corrupt file fails before any weight is."""
    cfg = read_hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weight files found")
    from safetensors import safe_open

    index: list[tuple[Path, str]] = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                index += [(f, name) for name in h.keys()]
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
    return cfg, _stream(index)


def _stream(index: list[tuple[Path, str]]) -> Iterator[tuple[str, torch.Tensor]]:
    for f, name in index:
        # Yielded with no local bound to it: the consumer's drop frees it.
        yield name, _read(f, name)


def _read(f: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    try:
        # A handle per tensor (see the module docstring); opening costs a header parse. The
        # tensor keeps the file's mapping alive past the handle, and ends it when dropped.
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(name)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
