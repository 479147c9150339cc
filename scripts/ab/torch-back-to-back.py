#!/usr/bin/env python3
"""PyTorch's FlashAttention-2 forward timed two ways on the GPU machine, as CSV (the columns of
torch_sdpa_bench.py): `torch-flash-dobench` by triton's do_bench (events around each call, a
cache clear before each), `torch-flash-b2b` as our bench times itself (batches of calls back to
back between two synchronisations, about 20 ms each, three rotating input sets, median per-call
time). bf16, d 128, n 2048/4096/8192, b = 16384 / n, h = 16, not causal.

    python3 scripts/ab/torch-back-to-back.py > OUT.csv
"""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

print("impl,dtype,b,h,hkv,n,d,causal,mode,ms,tflops")
for n in (2048, 4096, 8192):
    d, b, h = 128, 16384 // n, 16
    sets = [[torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            for _ in range(3)]
    flops = 4 * b * h * n * n * d
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        def call(i):
            return F.scaled_dot_product_attention(*sets[i % 3])
        for i in range(10):
            call(i)
        torch.cuda.synchronize()
        one = do_bench(lambda: call(0), warmup=25, rep=100, return_mode="median")
        batch = max(1, min(50, int(20 / one)))
        times = []
        for it in range(30):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for j in range(batch):
                call(it * batch + j)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / batch * 1e3)
        ms = sorted(times)[len(times) // 2]
        row = f"bf16,{b},{h},{h},{n},{d},False,fwd"
        print(f"torch-flash-dobench,{row},{one:.4f},{flops / one / 1e9:.1f}")
        print(f"torch-flash-b2b,{row},{ms:.4f},{flops / ms / 1e9:.1f}", flush=True)
