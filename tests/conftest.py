"""Session-wide test setup.

Without CUDA, the Triton kernels' tests run Triton's CPU interpreter. Triton decides at import
time whether its own language functions (``tl.max`` and the like) are interpreted, and importing
lightning imports Triton, so ``TRITON_INTERPRET=1`` must be set before any test module is
collected. The other tests do not use Triton; the variable changes nothing for them.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
