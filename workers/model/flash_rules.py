"""What flash-attn 2 accepts, in one place and without torch: the engine's config refuses a
setting it would refuse (when the config loads, not at the first step), the automatic backend
choice passes it over, and `tandem doctor` states the rule.

The figures are flash-attn's own checks (csrc/flash_attn/flash_api.cpp): a paged K/V cache
only in pages that are a multiple of 256 tokens ("Paged KV cache block size must be divisible
by 256"), fp16 or bf16 only, head sizes up to 256 in multiples of 8, Ampere (sm80) or newer.
The names of the attention backends are here too, so that the config checks them without torch.
"""

from __future__ import annotations

ATTENTION_BACKENDS = ("auto", "torch", "torch-sdpa", "flash-attn")
FLASH_PAGE_MULTIPLE = 256
FLASH_DTYPES = ("bfloat16", "float16")
FLASH_MAX_HEAD_DIM = 256
FLASH_MIN_CAPABILITY = (8, 0)


def flash_refusal(
    dtype: str | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why flash-attn would refuse this setting, naming the field; None if it would take it.
    A value left None is not checked."""
    if block_size is not None and block_size % FLASH_PAGE_MULTIPLE:
        return (
            f"block_size={block_size}: flash-attn pages the KV cache in multiples of "
            f"{FLASH_PAGE_MULTIPLE} tokens"
        )
    if dtype is not None and dtype not in FLASH_DTYPES:
        return f"dtype={dtype!r}: flash-attn takes {' or '.join(FLASH_DTYPES)} only"
    if head_dim is not None and (head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8):
        return (
            f"head_dim={head_dim}: flash-attn takes head sizes up to {FLASH_MAX_HEAD_DIM} "
            "in multiples of 8"
        )
    if capability is not None and tuple(capability) < FLASH_MIN_CAPABILITY:
        major, minor = capability
        return f"compute capability {major}.{minor}: flash-attn 2 needs 8.0 (Ampere) or newer"
    return None
