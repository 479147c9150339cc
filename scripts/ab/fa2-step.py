"""Two training steps of PyTorch's FlashAttention-2 backend, bf16, on the bench's shapes
(b = 16384 / n, h = 2048 / d): the peer `scripts/gpu-run.sh profile` puts beside ours.

    python3 scripts/ab/fa2-step.py D N
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

d, n = int(sys.argv[1]), int(sys.argv[2])
shape = (16384 // n, 2048 // d, n, d)
q, k, v = (
    torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
)
grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(2):
        F.scaled_dot_product_attention(q, k, v).backward(grad)
torch.cuda.synchronize()
