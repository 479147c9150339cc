#!/usr/bin/env python3
"""What the peers pay for issue 6's features: PyTorch's attention backends timed plain and with
dropout 0.1 (FlashAttention-2), an additive bias `[1, h, n, n]` and a random boolean mask
`[b, 1, n, n]` (10 % hidden; cuDNN and the memory-efficient backend), forward only, on the
bench's shapes (b = 16384 / n, h = 2048 / d). Same CSV and timing as torch_sdpa_bench.py
(triton's do_bench, median); a backend that refuses a variant prints an error row.

    python3 scripts/tables/peer-features.py [--d 64,128] [--n 2048,8192]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
# (backend, variant) pairs: what each backend is asked to run.
RUNS = [("flash", "plain"), ("flash", "drop0.1"), ("cudnn", "plain"), ("cudnn", "bias"),
        ("cudnn", "mask"), ("efficient", "plain"), ("efficient", "bias"), ("efficient", "mask")]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", default="64,128")
    p.add_argument("--n", default="2048,8192")
    a = p.parse_args()
    print("impl,dtype,b,h,hkv,n,d,causal,mode,ms,tflops", flush=True)
    for d in map(int, a.d.split(",")):
        for n in map(int, a.n.split(",")):
            b, h = max(16384 // n, 1), 2048 // d
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            bias = torch.randn(1, h, n, n, device="cuda", dtype=torch.bfloat16)
            # True keeps the pair in SDPA's boolean masks; 10 % hidden, no row wholly hidden.
            mask = torch.rand(b, 1, n, n, device="cuda") >= 0.1
            mask[..., 0] = True
            for causal in (False, True):
                fl = 4 * b * h * n * n * d / (2 if causal else 1)
                for backend, variant in RUNS:
                    row = f"torch-{backend}{'' if variant == 'plain' else '-' + variant},bf16,{b},{h},{h},{n},{d},{causal}"
                    kwargs = {"is_causal": causal}
                    if variant == "drop0.1":
                        kwargs["dropout_p"] = 0.1
                    elif variant in ("bias", "mask"):
                        if causal:  # SDPA takes a mask or is_causal, not both
                            continue
                        kwargs["attn_mask"] = bias if variant == "bias" else mask
                    try:
                        with sdpa_kernel(BACKENDS[backend]):
                            ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs),
                                          warmup=25, rep=100, return_mode="median")
                        print(f"{row},fwd,{ms:.4f},{fl / ms / 1e9:.1f}", flush=True)
                    except Exception as e:
                        print(f"{row},error,nan,nan  # {type(e).__name__}: {str(e)[:80]}", flush=True)
            del q, k, v, bias, mask
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
