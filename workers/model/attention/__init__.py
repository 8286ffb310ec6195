"""Attention backends over the paged KV cache, behind one interface, chosen by device."""

from workers.model.attention.base import AttentionBackend, AttentionMetadata, PrefillSlice
from workers.model.attention.selector import select_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillSlice", "select_backend"]
