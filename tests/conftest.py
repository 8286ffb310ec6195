"""Shared fixtures: tiny random Llama-family checkpoints written as HF folders (fast), and the
real SmolLM2 default (slow, integration tier)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory):
    """SmolLM2's tokenizer and chat template saved as an HF folder, shared by tiny models."""
    from workers.model.loader import resolve_model
    from workers.model.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tok")
    Tokenizer(resolve_model(None)).hf.save_pretrained(folder)
    return folder


def _tiny(kind: str, base, tmp_path_factory, **overrides):
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
    )
    common |= overrides
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
        model = LlamaForCausalLM(cfg)
    elif kind == "llama3":
        cfg = LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=10000.0)
        model = Qwen2ForCausalLM(cfg)
    folder = tmp_path_factory.mktemp(f"tiny-{kind}{'-' if overrides else ''}")
    model.save_pretrained(folder, safe_serialization=True)
    for f in base.iterdir():
        if f.is_file() and not (folder / f.name).exists():
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="session", params=["llama", "llama3", "qwen2"])
def tiny_model_dir(request, smollm2_tokenizer_dir, tmp_path_factory):
    return _tiny(request.param, smollm2_tokenizer_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_tokenizer_dir, tmp_path_factory):
    return _tiny("llama", smollm2_tokenizer_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_llama_hd64_dir(smollm2_tokenizer_dir, tmp_path_factory):
    """A tiny Llama with SmolLM2's head size (64), the one the bf16 attention kernels take."""
    return _tiny(
        "llama",
        smollm2_tokenizer_dir,
        tmp_path_factory,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
