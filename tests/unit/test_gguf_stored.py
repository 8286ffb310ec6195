"""GGUF weights served as stored (quantization: gguf): the blocks read from the file are the
weights the dequantizing loader gives, every linear layer is served by them, a layer whose
parts differ in width stays at the model's dtype, and what cannot be served is refused with
the tensor and its type named."""

import logging

import pytest
import torch
from safetensors.torch import load_file

from tests.gguf_files import write_gguf
from workers.engine.config import EngineConfig
from workers.model.config import CheckpointError
from workers.model.cpu_kernels import cpu_kernels
from workers.model.gguf_linear import BlockWeight
from workers.model.gguf_loader import open_gguf
from workers.model.linear import PackedLinear
from workers.model.loader import ModelSource, build_model, read_model_config

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(
    cpu_kernels() is None, reason="Tandem's CPU kernels did not build"
)


def tiny_gguf(folder, tmp_path, qtype: str, types: dict[str, str] | None = None):
    path = tmp_path / f"m-{qtype}.gguf"
    tensors = load_file(str(folder / "model.safetensors"))
    write_gguf(path, read_model_config(ModelSource(folder)), tensors, qtype, types)
    return path


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_stored_blocks_are_the_weights_the_loader_dequantizes(tiny_llama_dir, tmp_path, qtype):
    path = tiny_gguf(tiny_llama_dir, tmp_path, qtype)
    _, plain = open_gguf(path)
    dense = dict(plain)
    _, stream = open_gguf(path, stored=True)
    with_blocks = set()
    for name, tensor, *blocks in stream:
        if not blocks:
            assert torch.equal(tensor, dense[name])
            continue
        b = blocks[0]
        with_blocks.add(name)
        assert b.type_name == qtype and b.four_bit == (qtype != "Q8_0")
        q = b.q.float() - (8 if qtype == "Q4_0" else 0)
        w = b.d.float().repeat_interleave(32, 1) * q
        if b.m is not None:
            w += b.m.float().repeat_interleave(32, 1)
        assert torch.equal(w, dense[name]), name  # q and k rows unpermuted as the dense ones
        assert torch.equal(b.dequantized(), dense[name]), name
        # no dense copy of a weight served as stored, but for the looked-up embedding
        assert (tensor is None) == (name != "model.embed_tokens.weight"), name
    layer = {n.split(".", 3)[3] for n in with_blocks if n.startswith("model.layers.0.")}
    assert layer == {
        f"{m}.weight"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert "model.embed_tokens.weight" in with_blocks  # the tied lm_head's weight


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_every_linear_is_served_as_stored(tiny_model_dir, tmp_path, qtype, caplog):
    """Tied (llama, qwen2) and untied (llama3, its lm_head from output.weight) models, q and
    k unpermuted (llama's): every layer serves the file's blocks, near the dense weights."""
    cfg = read_model_config(ModelSource(tiny_model_dir))
    path = tiny_gguf(tiny_model_dir, tmp_path, qtype)
    full = build_model(ModelSource(path), torch.float32, CPU)
    with caplog.at_level(logging.INFO, logger="workers.model.gguf_linear"):
        stored = build_model(ModelSource(path), torch.float32, CPU, quantization="gguf")
    n = 4 * cfg.num_layers + 1
    assert f"{n} of {n} linear layers served as stored in the GGUF ({qtype}" in caplog.text
    linears = [m for m in stored.modules() if isinstance(m, PackedLinear)]
    assert all(isinstance(m.quantized, BlockWeight) and m.weight is None for m in linears)
    assert stored.embed_tokens.weight is not None  # looked up at full width
    x = torch.randn(7, cfg.hidden_size)
    for a, b in [
        (full.layers[1].qkv_proj, stored.layers[1].qkv_proj),
        (full.lm_head, stored.lm_head),
    ]:
        want, got = a(x, float_out=True), b(x, float_out=True)
        # the same weights; the activations' int8 rounding alone
        assert (got - want).norm() / want.norm() < 0.02
        assert torch.equal(b(x[2:3], float_out=True), got[2:3])  # rows stand alone


@needs_kernels
@pytest.mark.parametrize("tiny_model_dir", ["qwen2"], indirect=True)
def test_biases_are_added_after_the_stored_product(tiny_model_dir, tmp_path):
    """Qwen2's q, k and v have biases: the fused layer is served as stored, its bias after."""
    cfg = read_model_config(ModelSource(tiny_model_dir))
    assert cfg.qkv_bias and cfg.architecture == "qwen2"
    path = tiny_gguf(tiny_model_dir, tmp_path, "Q8_0")
    full = build_model(ModelSource(path), torch.float32, CPU)
    stored = build_model(ModelSource(path), torch.float32, CPU, quantization="gguf")
    layer = stored.layers[0].qkv_proj
    assert isinstance(layer.quantized, BlockWeight) and layer.quantized.bias is not None
    x = torch.randn(5, cfg.hidden_size)
    want, got = full.layers[0].qkv_proj(x), layer(x)
    assert (got - want).norm() / want.norm() < 0.02


@needs_kernels
def test_a_layer_whose_parts_differ_in_width_keeps_the_model_dtype(
    tiny_llama_dir, tmp_path, caplog
):
    path = tiny_gguf(
        tiny_llama_dir, tmp_path, "Q8_0", {"model.layers.0.self_attn.k_proj.weight": "Q4_0"}
    )
    with caplog.at_level(logging.INFO, logger="workers.model.gguf_linear"):
        model = build_model(ModelSource(path), torch.float32, CPU, quantization="gguf")
    assert "12 of 13 linear layers served as stored" in caplog.text
    assert "layers.0.self_attn" in caplog.text
    assert model.layers[0].qkv_proj.quantized is None  # packed at fp32 as usual
    assert isinstance(model.layers[0].o_proj.quantized, BlockWeight)
    # its weights came dense: the layer computes what the dequantizing load's does
    full = build_model(ModelSource(path), torch.float32, CPU)
    x = torch.randn(5, 64)
    assert torch.equal(model.layers[0].qkv_proj(x), full.layers[0].qkv_proj(x))


@needs_kernels
def test_an_lm_head_of_another_type_is_dequantized_not_refused(tiny_llama_dir, tmp_path, caplog):
    """llama.cpp's quantizer writes the lm_head in Q6_K beside Q4_0 layers: such a file is
    served, its lm_head at the model's dtype."""
    path = tiny_gguf(tiny_llama_dir, tmp_path, "Q4_0", {"model.embed_tokens.weight": "Q5_0"})
    with caplog.at_level(logging.INFO, logger="workers.model.gguf_linear"):
        model = build_model(ModelSource(path), torch.float32, CPU, quantization="gguf")
    assert "12 of 13 linear layers served as stored" in caplog.text
    assert "embed_tokens.weight" in caplog.text
    assert model.lm_head.quantized is None
    assert isinstance(model.layers[2].down_proj.quantized, BlockWeight)


def test_unservable_types_and_checkpoints_are_refused_by_name(tiny_llama_dir, tmp_path):
    path = tiny_gguf(
        tiny_llama_dir, tmp_path, "Q8_0", {"model.layers.2.mlp.down_proj.weight": "Q5_0"}
    )
    with pytest.raises(CheckpointError, match=r"'blk\.2\.ffn_down\.weight' is Q5_0.*'none'"):
        build_model(ModelSource(path), torch.float32, CPU, quantization="gguf")
    build_model(ModelSource(path), torch.float32, CPU)  # dequantized at load, as before
    with pytest.raises(CheckpointError, match="HF folder"):
        build_model(ModelSource(tiny_llama_dir), torch.float32, CPU, quantization="gguf")
    with pytest.raises(ValueError, match="is an HF folder"):  # and when the config loads
        EngineConfig(quantization="gguf", model=str(tiny_llama_dir))
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(quantization="gguf", device="cuda")
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(quantization="gguf").resolve(cuda=True, bf16=True)
