import json

import pytest
import torch

from workers.engine.config import EngineConfig
from workers.model.config import CheckpointError
from workers.model.loader import ModelSource, build_model, read_checkpoint, resolve_model


def test_missing_and_wrong_paths(tmp_path):
    with pytest.raises(CheckpointError, match="no such model file or folder"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="must be .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: missing"):
        read_checkpoint(ModelSource(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_checkpoint(ModelSource(tmp_path))


def test_corrupt_gguf_names_the_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(CheckpointError, match="broken.gguf"):
        read_checkpoint(ModelSource(bad))


def test_missing_or_misshapen_tensor(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    broken = dict(tensors)
    del broken["model.layers.1.mlp.up_proj.weight"]
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'layers.1.mlp.up_proj.weight' is missing"):
        build_model(ModelSource(tmp_path), torch.float32, torch.device("cpu"))
    broken = dict(tensors)
    broken["model.norm.weight"] = torch.ones(3)
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'norm.weight' has shape \(3,\)"):
        build_model(ModelSource(tmp_path), torch.float32, torch.device("cpu"))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable"):
        build_model(ModelSource(tmp_path), torch.float32, torch.device("cpu"))


def test_engine_config_validation_names_fields():
    with pytest.raises(ValueError, match="dtype='int8'"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="block_size=12"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="float16' is for GPUs"):
        EngineConfig(dtype="float16")


def test_flash_attn_without_the_package_says_so():
    from workers.model.attention import select_backend

    with pytest.raises(ValueError, match="CUDA devices only"):
        select_backend("flash-attn", torch.device("cpu"))
    pytest.importorskip("torch.cuda")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        from workers.model.attention.flash_backend import import_flash_attn

        with pytest.raises(RuntimeError, match="needs the flash-attn package"):
            import_flash_attn()
