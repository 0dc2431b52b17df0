"""The Triton-interpreter shim for NumPy >= 2.4 applies exactly where Triton's own interpreter breaks."""

from __future__ import annotations

import types

import numpy
import pytest

from pdserve.kernels import triton_interpreter_compat as compat


@pytest.mark.parametrize(("triton_version", "numpy_version", "needed"), [
    ("3.6.0", "2.5.2", True),   # torch 2.11's pinned Triton with a current NumPy: the broken pair
    ("3.5.1", "2.4.0", True),
    ("3.6.0", "2.3.5", False),  # NumPy still only warned
    ("3.7.0", "2.5.2", False),  # fixed in Triton 3.7
    ("3.10.0", "2.4.6", False),
    ("3.6.0+git1234", "2.4.0rc1", True),
])
def test_needed_only_for_old_triton_with_strict_numpy(triton_version, numpy_version, needed):
    assert compat.needed(triton_version, numpy_version) is needed


@pytest.mark.parametrize("data", [numpy.array([7], dtype=numpy.int32), numpy.array(7, dtype=numpy.int64)])
def test_index_reads_the_one_element_of_a_scalar_handle(data):
    scalar = types.SimpleNamespace(handle=types.SimpleNamespace(data=data))
    assert compat._index(scalar) == 7 and type(compat._index(scalar)) is int


def test_a_strict_numpy_rejects_what_the_old_interpreter_did():
    # The failure the shim avoids: int() of a one-element array is a TypeError from NumPy 2.4 on.
    if compat._release(numpy.__version__) < compat.STRICT_NUMPY:
        pytest.skip(f"NumPy {numpy.__version__} only warns")
    with pytest.raises(TypeError, match="0-dimensional"):
        int(numpy.array([7]))
