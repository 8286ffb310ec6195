"""Tandem's C++ kernels for the CPU, compiled on first use with torch's JIT extension builder
and cached (TORCH_EXTENSIONS_DIR, about 30 s once per machine):

- `paged_decode_attention`: decode attention read straight off the paged cache. Gathering
  every sequence's blocks into a padded batch costs more than the attention itself on the
  CPU; the kernel reads blocks in place and stops at each sequence's own length.
- `rms_norm`, `add_rms_norm`, `rotary_inplace`, `silu_and_mul`: the decoder layer's small
  ops, fused (csrc/layer_ops_cpu.cpp). A small model's decode step is mostly the dispatch of
  such ops, not their arithmetic.
- `scatter_blocks`, `gather_blocks`: a KV transfer's staged blocks copied into their
  reserved blocks, or out of held ones, a block at a time on the calling thread;
  `write_slots`: a step's new K/V rows into their slots (index_copy_ goes element by
  element).
- `argmax_rows`: greedy picks over the vocabulary (torch's argmax is ten times slower).
- `pack_linear_bf16`, `linear_bf16`: bf16 linear layers on CPUs with AVX512-BF16
  (csrc/linear_bf16_cpu.cpp; `linear_bf16_supported` says whether this build has them).
- `pack_linear_int8`, `linear_int8`: int8 weights (quantization: int8) against activations
  quantized in groups of 32 or 64 inputs, on AVX512-VNNI where built, else on a portable path
  with the same operations and results (csrc/linear_int8_cpu.cpp).
- `prefill_attention_bf16`: a bf16 prefill chunk's causal attention read off the paged cache,
  flash-style on the same instructions (csrc/prefill_attention_cpu.cpp); torch's CPU flash
  kernel computes in fp32 and reaches about half its speed.

If the build fails (no compiler), the model keeps its torch paths and says so once.
Set TANDEM_CPU_KERNELS=0 to skip the kernels (and the oneDNN weight packing, linear.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / "paged_attention_cpu.cpp",
    _CSRC / "layer_ops_cpu.cpp",
    _CSRC / "linear_bf16_cpu.cpp",
    _CSRC / "linear_int8_cpu.cpp",
    _CSRC / "prefill_attention_cpu.cpp",
]
_FUNCTIONS = [
    "paged_decode_attention",
    "rms_norm",
    "add_rms_norm",
    "rotary_inplace",
    "silu_and_mul",
    "scatter_blocks",
    "gather_blocks",
    "write_slots",
    "argmax_rows",
    "linear_bf16_supported",
    "pack_linear_bf16",
    "linear_bf16",
    "linear_int8_vnni_supported",
    "pack_linear_int8",
    "linear_int8",
    "pack_linear_int4",
    "linear_blocks",
    "prefill_attention_bf16_supported",
    "prefill_attention_bf16",
]
# Vectorising the fp32 reductions needs reassociation. Infinities and NaN keep their meaning
# (no -ffinite-math-only): argmax_rows sees banned tokens' -inf and must rank a NaN as torch does.
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


def cpu_kernels():
    """The compiled module (every function in `_FUNCTIONS`), or None when disabled or
    unbuildable."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:  # a second caller waits for the build rather than going without
        if not _tried:
            _module = _build()
            _tried = True
        return _module


def cpu_info() -> tuple[str, frozenset[str]]:
    """This CPU's model name and its flags (/proc/cpuinfo; elsewhere the platform's name
    and no flags)."""
    model, flags = None, frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    if model is None:
        import platform

        model = platform.processor() or platform.machine()
    return model, flags


def _cpu_tag() -> str:
    """A short hash of this CPU's model and flags: the build is `-march=native`, and torch's
    cache keys only on sources and flags, so a cache shared between different CPUs must not
    hand one of them the other's binary."""
    model, flags = cpu_info()
    return hashlib.sha1(f"{model}\n{' '.join(sorted(flags))}".encode()).hexdigest()[:10]


def _module_name() -> str:
    return f"tandem_cpu_kernels_v15_{_cpu_tag()}"


def built() -> bool:
    """Whether this machine's build is in torch's extension cache, without building it."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(_module_name(), verbose=False))
    return (folder / f"{_module_name()}.so").is_file()


def switched_off() -> bool:
    """TANDEM_CPU_KERNELS=0: no kernels and no weight packing, torch ops alone."""
    return os.environ.get("TANDEM_CPU_KERNELS", "1") == "0"


def _bindings() -> str:
    """The module's bindings: as load_inline's own (`functions=`), each function is wrapped for
    torch's error handling (a failed check raises RuntimeError with its message alone), and
    it also lets go of the GIL while it runs, as torch's ops do. Bound so by default, a
    kernel held the GIL to its end: a worker's other Python threads (the KV sender streaming
    a prefill's layers, the token relay, a router's poll, a status call) stood still through
    every linear and attention call of the engine thread, tens of milliseconds a call in a
    long prompt's chunk. The kernels take and return tensors and scalars only, and touch no
    Python object; what two threads may run at once (a block gather for a transfer beside a
    step) reads and writes different blocks."""
    defs = "".join(
        f'  m.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");\n' for f in _FUNCTIONS
    )
    return f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}}}\n"


def _build():
    if switched_off():
        log.info("TANDEM_CPU_KERNELS=0: the CPU path runs on torch ops alone")
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name=_module_name(),
            cpp_sources=[src.read_text() for src in _SOURCES] + [_bindings()],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # a missing compiler must not stop the engine
        log.warning("CPU kernels unavailable (%s); using torch ops (slower decode steps)", e)
        return None
