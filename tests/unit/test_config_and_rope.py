import pytest
import torch

from workers.model.config import CheckpointError, ModelConfig
from workers.model.rope import inverse_frequencies

BASE = dict(
    model_type="llama",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_rope_theta_from_4x_and_5x_config_forms():
    v4 = ModelConfig.from_hf({**BASE, "rope_theta": 12345.0})
    v5 = ModelConfig.from_hf(
        {**BASE, "rope_parameters": {"rope_theta": 12345.0, "rope_type": "default"}}
    )
    assert v4.rope_theta == v5.rope_theta == 12345.0
    assert v4.rope_scaling is None and v5.rope_scaling is None
    scaled = ModelConfig.from_hf(
        {**BASE, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}
    )
    assert scaled.rope_scaling["rope_type"] == "llama3"


def test_llama3_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    cfg = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        rope_scaling=params,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inverse_frequencies(128, 500000.0, params)
    torch.testing.assert_close(ours, theirs.float())


def test_config_errors_name_the_field():
    with pytest.raises(CheckpointError, match="'intermediate_size' is missing"):
        ModelConfig.from_hf({k: v for k, v in BASE.items() if k != "intermediate_size"})
    with pytest.raises(CheckpointError, match="not a Llama-family"):
        ModelConfig.from_hf({**BASE, "model_type": "gpt2"})
    with pytest.raises(CheckpointError, match="not a multiple"):
        ModelConfig.from_hf({**BASE, "num_key_value_heads": 3})


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        inverse_frequencies(64, 1e4, {"rope_type": "yarn", "factor": 2.0})
