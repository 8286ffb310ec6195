"""What a KV block holds. Two caches exchange blocks only when their layouts are equal."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3, "float8_e4m3fn": 4}
FP8_DTYPES = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor (kv_cache_dtype: fp8) as the bytes it is, for what takes no fp8 dtype
    (gloo's sends, index_copy_ on the CPU); any other tensor as it is."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES else tensor


class LayoutMismatch(ValueError):
    """The two sides of a transfer disagree on the KV layout; no bytes were moved."""


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype={self.dtype!r}: choose from {', '.join(DTYPE_CODES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token, every layer."""
        return self.bytes_per_block // self.block_size

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer of a paged cache, or of a transfer: each block's K and V side by side,
        `[blocks, 2, block_size, kv_heads, dim]`."""
        return (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def check_compatible(self, other: KVLayout) -> None:
        diffs = [
            f"{k}: {a!r} here, {b!r} there"
            for (k, a), b in zip(asdict(self).items(), asdict(other).values())
            if a != b
        ]
        if diffs:
            raise LayoutMismatch("KV layouts differ (" + "; ".join(diffs) + ")")
