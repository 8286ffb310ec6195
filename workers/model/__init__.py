"""Model execution: the Llama-family decoder, checkpoint loaders and attention backends."""

from workers.model.config import ModelConfig

__all__ = ["ModelConfig"]
