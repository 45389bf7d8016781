"""Session-wide test setup.

Triton reads TRITON_INTERPRET when a kernel is decorated (its module's first
import), and any test module may import one, so the CPU interpreter is switched on
here, before collection imports anything. On a CUDA machine kernels compile for
the device.

The README's test command spreads the test files over two worker processes (pytest-xdist's
``-n 2 --dist loadfile``); each worker then computes on one thread (torch, OpenMP and the
BLAS), so two workers share a 2-core machine instead of four threads contending for it.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _row_invariant_interpreter_dot() -> None:
    """The interpreter multiplies ``tl.dot`` tiles with ``np.matmul``, whose BLAS kernel (OpenBLAS's
    for AMD and Haswell cores) sums a row's products in an order that depends on the row's place
    in its micro-panel, so a tile's row is not bit for bit the same at every place, where a GPU's
    MMA gives each row the same sums. The batch-invariance tests need the GPU's property, so
    float16 / float32 tiles (FP8 ones widened to float16 first, as the interpreter does) are
    multiplied by ``np.einsum`` without BLAS instead: each output element summed over K in order
    in float32, whatever its row or the operands' layout."""
    import numpy as np
    import triton
    from triton.runtime import interpreter

    needed = ("InterpreterBuilder", "TensorHandle", "_convert_float")
    missing = [name for name in needed if not hasattr(interpreter, name)]
    if missing or not hasattr(getattr(interpreter, "InterpreterBuilder", None), "create_dot"):
        raise RuntimeError(f"tests/conftest.py replaces the Triton interpreter's tl.dot, but triton "
                           f"{triton.__version__} lacks {missing or ['InterpreterBuilder.create_dot']}: "
                           "adapt _row_invariant_interpreter_dot to this version (the batch-invariance "
                           "tests need a row-invariant dot in the interpreter)")
    builder = interpreter.InterpreterBuilder
    blas_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
            a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        floats = (np.float16, np.float32)
        if d.data.dtype != np.float32 or a_data.dtype not in floats or b_data.dtype not in floats:
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.einsum("...ik,...kj->...ij", a_data.astype(np.float32, order="C"),
                         b_data.astype(np.float32, order="C"), optimize=False)
        return interpreter.TensorHandle(prod + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_invariant_interpreter_dot()

