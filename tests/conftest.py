"""Session-wide test setup.

Without CUDA, the Triton kernels' tests run Triton's CPU interpreter. Triton decides at import
time whether its own language functions (``tl.max`` and the like) are interpreted, and importing
lightning imports Triton, so ``TRITON_INTERPRET=1`` must be set before any test module is
collected. The other tests do not use Triton; the variable changes nothing for them.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: What a launcher run inside the pytest process leaves in its environment (Lightning's subprocess
#: launcher sets them for the ranks it starts): a later test's subprocess would inherit a port that
#: may still be held, and fail with EADDRINUSE (examples/rlhf.py after test_trainer.py).
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
                     "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def _launch_environment_restored():
    """Each test leaves the launch variables as it found them."""
    before = {key: os.environ.get(key) for key in _LAUNCH_VARIABLES}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
