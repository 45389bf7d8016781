"""Session-wide test setup.

Triton reads TRITON_INTERPRET when a kernel is decorated (its module's first
import), and any test module may import one, so the CPU interpreter is switched on
here, before collection imports anything. On a CUDA machine kernels compile for
the device.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

