"""Triton's CPU interpreter, made to run the kernels' tests under NumPy 2.4 and later with a
Triton before 3.7 (CUDA builds of torch 2.11 pin Triton 3.6). There, a Triton tensor's
`__index__` (a loop bound, an index) calls int() on a one-element array, which NumPy 2.4
refuses ("only 0-dimensional arrays can be converted to Python scalars",
triton-lang/triton#9171); Triton 3.7 squeezes the array first, and so does this, for those
versions alone. Import it, in a process with TRITON_INTERPRET=1, before any kernel runs."""

import numpy
import triton
import triton.runtime.interpreter as interpreter


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2])


if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
    _patch = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = _patch_lang_tensor
