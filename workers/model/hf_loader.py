"""Reads a Hugging Face checkpoint folder: config.json plus one or more *.safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from workers.model.config import CheckpointError, ModelConfig


def load_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing (a model folder needs config.json)")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from e
    cfg = ModelConfig.from_hf(raw, source=str(config_path))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weight files found")
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
    return cfg, tensors
