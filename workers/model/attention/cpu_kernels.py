"""A C++ paged decode-attention kernel for the CPU, compiled on first use with torch's JIT
extension builder and cached (TORCH_EXTENSIONS_DIR, ~20 s once per machine).

Gathering every sequence's blocks into a padded batch costs more than the attention itself
on the CPU; the kernel reads blocks in place and stops at each sequence's own length.
If the build fails (no compiler), the torch backend keeps its SDPA path and says so once.
Set TANDEM_CPU_KERNELS=0 to skip the kernel.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# Vectorising the fp32 reductions needs reassociation; the kernel never sees inf or NaN.
_CFLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]
_lock = threading.Lock()
_module = None
_tried = False


def paged_decode_kernel():
    """The compiled `paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)`, or
    None when disabled or unbuildable."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
            log.info("TANDEM_CPU_KERNELS=0: CPU decode attention uses torch SDPA")
            return None
        try:
            from torch.utils.cpp_extension import load_inline

            _module = load_inline(
                name="tandem_paged_attention_cpu_v1",
                cpp_sources=[_SOURCE.read_text()],
                functions=["paged_decode_attention"],
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
            )
        except Exception as e:  # a missing compiler must not stop the engine
            log.warning("CPU paged-attention kernel unavailable (%s); using torch SDPA", e)
            _module = None
        return _module
