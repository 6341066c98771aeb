"""Shared test setup. Triton kernels run in the interpreter when there is no GPU; the variable must be
set before triton is first imported, which is why it happens here, in the root conftest."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
