"""What Tandem's Triton kernels share (attention/triton_decode.py, triton_layer_ops.py): triton,
imported if it can be (this module imports without it, and `triton_unavailable` says why),
`jit`, whether the interpreter runs the kernels, and rounding to a dtype the interpreter gets
right."""

from __future__ import annotations

import os

import torch

try:  # this module must import without triton; triton_unavailable() says why it is missing
    import triton
    import triton.language as tl

    IMPORT_ERROR = None
except Exception as e:  # a broken install raises more than ImportError
    triton = tl = None
    IMPORT_ERROR = "triton is not installed" if isinstance(e, ImportError) else f"triton: {e}"


def jit(fn=None, **options):
    """triton.jit (with its options, e.g. do_not_specialize), or the function itself where
    triton is missing."""
    if fn is None:
        return lambda f: jit(f, **options)
    return fn if triton is None else triton.jit(fn, **options)


def interpreting() -> bool:
    """Whether kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable() -> str | None:
    """None when the kernels can run here, else a short reason."""
    if triton is None:
        return IMPORT_ERROR
    if not interpreting() and not torch.cuda.is_available():
        return "no CUDA device for triton (TRITON_INTERPRET=1 runs it on the CPU)"
    return None


def first_launch_failure(launch, device: torch.device) -> str | None:
    """Why `launch()` (a kernel's first launch, made at start so that a kernel that cannot
    compile here is found then, not at the first step) failed on `device`; None if it ran."""
    why = triton_unavailable()
    if why is not None:
        return why
    try:
        launch()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # whatever the compiler or driver raised
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"its first launch failed: {type(e).__name__}: {first}"
    return None


@jit
def as_operand(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 `x` rounded to DTYPE; under UPCAST kept in fp32 holding the rounded value (the
    interpreter multiplies bf16 dot operands as raw bits, triton-lang/triton#11584)."""
    if not UPCAST:
        y = x.to(DTYPE)
    elif DTYPE == tl.bfloat16:  # round to nearest even by hand: the interpreter's cast truncates
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        # NaN stays NaN (the sum would carry a GPU's 0x7FFFFFFF over into -0.0).
        y = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y  # one return: the compiler checks every return's type, even in pruned branches
