#!/usr/bin/env python3
"""Time PyTorch's attention on variable-length batches (CSV on stdout), the peer of
`benches/varlen.rs`.

The same lengths as the Rust bench (`--tokens` rows in sequences uniform in 1..2*mean, drawn by
splitmix64 from `--seed`, the last one cut), self-attention, bf16. Rows:

- `torch-flash-varlen`: SDPA's flash backend on nested jagged tensors (`torch.nested`, the
  packed sequences without padding: PyTorch's variable-length attention);
- `torch-flash-padded`, `torch-cudnn-padded`: SDPA's flash and cuDNN backends on the sequences
  padded to the longest, `[b, h, longest, d]`, as `burn-flash-padded` runs them.

Run it on the GPU machine in the same command as the Rust bench:

    python3 scripts/torch_varlen_bench.py --mean 512,2048 --d 64,128

Columns: impl,dtype,seqs,tokens,longest,h,hkv,d,causal,mode,ms,tflops, as the Rust bench's;
TFLOPS counts the real tokens' work only (4*h*d*sum(l^2), halved when causal, times 3.5 for
fwdbwd). `ms` is the median over `--iters` samples of calls issued back to back (about 20 ms of
them, at most 50), between CUDA events: the Rust bench's method. A backend that refuses a shape
prints a `nan` row with the reason.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MASK = (1 << 64) - 1


def splitmix64(seed, n):
    z = (seed + (n + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def lengths(tokens, mean, seed):
    out, total = [], 0
    while total < tokens:
        n = 1 + splitmix64(seed, len(out)) % (2 * mean - 1)
        n = min(n, tokens - total)
        out.append(n)
        total += n
    return out


def ints(s):
    return [int(x) for x in s.split(",") if x]


def timed(fn, iters):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    batch = max(1, min(50, int(20.0 / max(start.elapsed_time(end), 1e-3))))
    samples = []
    for _ in range(iters):
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / batch)
    samples.sort()
    return samples[len(samples) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mean", default="512,2048")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--d", default="64,128")
    p.add_argument("--h", type=int, default=0)
    p.add_argument("--causal", default="both")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    dtype = torch.bfloat16
    causals = [False, True] if a.causal == "both" else [a.causal == "true"]
    print("impl,dtype,seqs,tokens,longest,h,hkv,d,causal,mode,ms,tflops", flush=True)
    for mean in ints(a.mean):
        lens = lengths(a.tokens, mean, a.seed)
        longest, b = max(lens), len(lens)
        for d in ints(a.d):
            h = a.h or 2048 // d
            for mode in a.modes.split(","):
                backward = mode == "fwdbwd"
                for causal in causals:
                    pairs = sum(l * (l + 1) // 2 if causal else l * l for l in lens)
                    flops = 4.0 * h * d * pairs * (3.5 if backward else 1.0)

                    def nested():
                        parts = [torch.randn(l, h, d, device="cuda", dtype=dtype) for l in lens]
                        t = torch.nested.nested_tensor(parts, layout=torch.jagged,
                                                       requires_grad=backward)
                        return t.transpose(1, 2)

                    def padded():
                        return torch.randn(b, h, longest, d, device="cuda", dtype=dtype,
                                           requires_grad=backward)

                    rows = [("torch-flash-varlen", SDPBackend.FLASH_ATTENTION, nested),
                            ("torch-flash-padded", SDPBackend.FLASH_ATTENTION, padded),
                            ("torch-cudnn-padded", SDPBackend.CUDNN_ATTENTION, padded)]
                    for name, backend, make in rows:
                        prefix = f"{name},bf16,{b},{a.tokens},{longest},{h},{h},{d},{causal},{mode}"
                        try:
                            q, k, v = make(), make(), make()

                            def call():
                                with sdpa_kernel(backend):
                                    out = F.scaled_dot_product_attention(q, k, v,
                                                                         is_causal=causal)
                                if backward:
                                    # A nested output's packed values (its `[total, h, d]`
                                    # buffer), as burn-flash's rows; the padded one whole.
                                    loss = (out.transpose(1, 2).values() if out.is_nested
                                            else out).sum()
                                    loss.backward()

                            ms = timed(call, a.iters)
                            print(f"{prefix},{ms:.4f},{flops / (ms * 1e-3) / 1e12:.1f}",
                                  flush=True)
                        except Exception as e:  # a backend that refuses the shape
                            reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                            print(f"{prefix},nan,nan\n# {name}: {reason}", flush=True)
                        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
