import os

import torch

# Triton kernels run under the interpreter on machines without a GPU. The flag is
# read when a kernel is decorated, so it must be set before any kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
