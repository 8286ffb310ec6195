import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.gguf_files import quant_round_trip, write_gguf
from workers.engine.config import EngineConfig
from workers.model.config import CheckpointError, ModelConfig
from workers.model.loader import (
    ModelSource,
    build_model,
    read_checkpoint,
    read_model_config,
    resolve_model,
)


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
        EngineConfig(device="cpu", dtype="float16")


def test_flash_attn_without_the_package_says_so():
    """Where flash-attn is missing (this machine), asking for it names the package, how to
    install it, and the backend that runs without it; on the CPU it is refused at once."""
    from workers.model.attention import select_backend
    from workers.model.attention.flash_backend import FlashAttentionBackend, flash_attn_unavailable

    with pytest.raises(ValueError, match="CUDA devices only"):
        select_backend("flash-attn", torch.device("cpu"))
    if flash_attn_unavailable() is None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(RuntimeError, match="flash-attn is not installed") as e:
        FlashAttentionBackend()
    assert "--no-build-isolation" in str(e.value) and "attention_backend to auto" in str(e.value)


# --- Loading streams the checkpoint into a model built on the meta device ---------------------


def _unpacked(monkeypatch):
    # Weights stay plain tensors (packing replaces them with oneDNN's layout, and drops a tied
    # lm_head's reference to the embedding).
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_loads_the_same_weights_as_safetensors(tiny_llama_dir, tmp_path, monkeypatch, qtype):
    """Names, q/k unpermuting (across dequantization slices) and fused rows, against the same
    weights loaded from an HF folder."""
    from safetensors.torch import load_file, save_file

    from workers.model import gguf_loader

    _unpacked(monkeypatch)
    monkeypatch.setattr(gguf_loader, "_SLICE", 1000)  # 15 rows of 64: q/k span several slices
    tensors = quant_round_trip(load_file(str(tiny_llama_dir / "model.safetensors")), qtype)
    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", folder)
    save_file(tensors, str(folder / "model.safetensors"))
    write_gguf(tmp_path / "m.gguf", read_model_config(ModelSource(folder)), tensors, qtype)
    cpu = torch.device("cpu")
    want = build_model(ModelSource(folder), torch.float32, cpu)
    got = build_model(ModelSource(tmp_path / "m.gguf"), torch.float32, cpu)
    for (name, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_tied_embeddings_stay_one_storage(tiny_model_dir, monkeypatch):
    _unpacked(monkeypatch)
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(ModelSource(tiny_model_dir), dtype, torch.device("cpu"))
        head, embed = model.lm_head.weight, model.embed_tokens.weight
        assert head.dtype == embed.dtype == dtype
        same = head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
        assert same == model.cfg.tie_word_embeddings
        if model.cfg.tie_word_embeddings:
            assert head is embed


def test_rope_tables_stay_float32_whatever_the_weights_dtype(tiny_model_dir):
    """bf16 weights, float32 tables equal to ones computed directly (no round trip through the
    weights' dtype)."""
    from workers.model.rope import RotaryEmbedding

    model = build_model(ModelSource(tiny_model_dir), torch.bfloat16, torch.device("cpu"))
    cfg = model.cfg
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    rope = RotaryEmbedding(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    )
    assert model.rope.cos.dtype == model.rope.sin.dtype == torch.float32
    assert torch.equal(model.rope.cos, rope.cos) and torch.equal(model.rope.sin, rope.sin)


def test_a_missing_slice_of_a_fused_weight_is_named(tiny_llama_dir, tmp_path):
    """Every parameter is filled from the checkpoint or the load fails: a fused weight with one
    of its parts missing is not left partly uninitialised."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    for gone in ("model.layers.2.self_attn.v_proj.weight", "model.layers.0.input_layernorm.weight"):
        save_file(
            {k: v for k, v in tensors.items() if k != gone}, str(tmp_path / "model.safetensors")
        )
        with pytest.raises(CheckpointError, match=f"'{gone.removeprefix('model.')}' is missing"):
            build_model(ModelSource(tmp_path), torch.float32, torch.device("cpu"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"'layers.1.self_attn.k_proj.weight' has shape \(3, 64\), expected \(32, 64\)",
    ):
        build_model(ModelSource(tmp_path), torch.float32, torch.device("cpu"))


# A Llama of ~200 MB in float32 whose largest tensor is 16 MB: holding the checkpoint (or a
# second copy of the model) would show as ~200 MB over the model's own size.
_BIG = dict(
    vocab_size=4096,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=3,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    architectures=["LlamaForCausalLM"],
    model_type="llama",
)
# Loaded first, unmeasured: the first load's imports and lazily loaded libraries (~150 MB) are
# paid once per process, not per model.
_WARM_UP = _BIG | dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
)

_MEASURE = r"""
import json, sys, torch
from pathlib import Path
from workers.model.loader import ModelSource, build_model


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


build_model(ModelSource(Path(sys.argv[1])), torch.float32, torch.device("cpu"))  # not kept
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the resident size now
except OSError as e:
    sys.exit(print(json.dumps({"skip": f"cannot reset the peak resident size: {e}"})))
before = status("VmRSS")
model = build_model(ModelSource(Path(sys.argv[2])), torch.float32, torch.device("cpu"))
peak = status("VmHWM")
storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*model.parameters(), *model.buffers()]}
print(json.dumps({"growth": peak - before, "model": sum(storages.values())}))
"""


def _llama_tensors(c: dict) -> dict[str, torch.Tensor]:
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    shapes["lm_head.weight"] = (v, h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in shapes.items()}


def _write_checkpoint(folder, fmt: str, cfg: dict) -> tuple[Path, int]:
    """A random Llama as an HF folder (two shards, as big checkpoints come) or a Q8_0 GGUF;
    with its largest tensor's size in float32."""
    from safetensors.torch import save_file

    tensors = _llama_tensors(cfg)
    largest = max(t.nbytes for t in tensors.values())
    folder.mkdir()
    if fmt == "gguf":
        write_gguf(folder / "model.gguf", ModelConfig.from_hf(cfg), tensors, "Q8_0")
        return folder / "model.gguf", largest
    (folder / "config.json").write_text(json.dumps(cfg))
    names = list(tensors)
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({n: tensors[n] for n in part}, str(folder / f"model-{k}.safetensors"))
    return folder, largest


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_loading_holds_one_tensor_at_a_time_in_host_memory(tmp_path, fmt):
    """Peak resident memory while loading, less the model's own weights (on the CPU the model
    is host memory), stays under 1.5 times the largest tensor plus a constant: the checkpoint
    is never held whole, nor the model twice."""
    import os
    import subprocess
    import sys

    if not Path("/proc/self/clear_refs").exists():  # Linux's, to reset the peak resident size
        pytest.skip("needs /proc/self/clear_refs")
    warm_up, _ = _write_checkpoint(tmp_path / "warm-up", fmt, _WARM_UP)
    big, largest = _write_checkpoint(tmp_path / "big", fmt, _BIG)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TANDEM_CPU_KERNELS": "0", "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(warm_up), str(big)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in m:
        pytest.skip(m["skip"])
    mib = 2**20
    over = m["growth"] - m["model"]
    print(
        f"{fmt}: peak growth {m['growth'] / mib:.0f} MiB, model {m['model'] / mib:.0f} MiB, "
        f"over the model {over / mib:.0f} MiB, largest tensor {largest / mib:.0f} MiB"
    )
    assert m["model"] > 10 * largest  # else the bound below would not tell streaming apart
    assert over < 1.5 * largest + 64 * mib
