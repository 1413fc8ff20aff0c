import os

import torch

# Triton kernels run in the interpreter on machines without a GPU; it must be set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
