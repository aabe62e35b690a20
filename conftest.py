"""pytest setup: without a GPU, run the Triton kernel (kernel.py) in triton's CPU
interpreter. triton reads TRITON_INTERPRET when a kernel is decorated, so this
must happen before any test module imports kernel.py."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
