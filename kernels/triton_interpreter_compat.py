"""Let Triton releases before 3.7 interpret pdserve's kernels under NumPy 2.4 and later.

Under TRITON_INTERPRET=1 a kernel's scalars (a program id, a length read with tl.load) are
one-element NumPy arrays. A loop such as `for start in range(0, seq_len, BLOCK_N)` turns them into
Python ints through the interpreter's `tensor.__index__`, which before Triton 3.7 was
`int(self.handle.data)`. NumPy 2.4 made converting an array with ndim > 0 to a scalar a TypeError,
so on (Triton <= 3.6, NumPy >= 2.4), for example torch 2.11's pinned Triton 3.6 with NumPy 2.5,
every attention kernel failed under the interpreter with "only 0-dimensional arrays can be
converted to Python scalars" (triton-lang/triton issue 9171). Triton 3.7 reads the element with
`.squeeze()` first; `apply()` gives older releases the same `__index__`. Compiled GPU kernels
never take this path.
"""

from __future__ import annotations

import functools

import numpy
import triton

FIXED_IN = (3, 7)
STRICT_NUMPY = (2, 4)  # NumPy release that turned the array -> scalar conversion into a TypeError


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def needed(triton_version: str = triton.__version__, numpy_version: str = numpy.__version__) -> bool:
    """Whether this Triton's interpreter breaks on this NumPy's array -> int conversion."""
    return _release(triton_version) < FIXED_IN and _release(numpy_version) >= STRICT_NUMPY


def _index(tensor) -> int:
    return int(tensor.handle.data.reshape(()))  # the one element of a [1] or [] array


def apply() -> bool:
    """Give the interpreter's tl.tensor a NumPy-2.4-safe __index__ where needed; True if patched."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if not needed() or original is None or getattr(original, "pdserve_compat", False):
        return False

    @functools.wraps(original)
    def patch_lang_tensor(tensor, *args, **kwargs):
        result = original(tensor, *args, **kwargs)
        scope = args[0] if args else kwargs.get("scope")
        if scope is not None:  # Triton 3.5-3.6 restore what a scope set after each launch
            scope.set_attr(tensor, "__index__", _index)
        else:
            tensor.__index__ = _index
        return result

    patch_lang_tensor.pdserve_compat = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
