#!/usr/bin/env python3
"""Time PyTorch's attention on decode shapes (CSV on stdout), the peer of `benches/decode.rs`.

`sq` new queries of `hq` heads attend to `sk` cached keys of `hkv` heads, causal aligned
bottom-right (the new queries are the cache's last positions; with sq = 1 every cached key is
visible, so no mask is passed). Run it on the GPU machine in the same command as the Rust bench,
so that both are measured on the same card at the same time:

    python3 scripts/torch_decode_bench.py --b 1,8,64 --sk 4096,16384,131072 --hkv 32,8,4

Columns: impl,dtype,b,hq,hkv,sq,sk,d,ms,gbps, as the Rust bench's. GB/s counts the keys and
values once per key/value head plus the queries and the output; `ms` is the median of
triton.testing.do_bench, which clears the L2 cache before each call by zeroing 256 MB (the
call then finds it full of written lines, which its reads write back as they evict them);
`--clear read` instead sums 1 GiB before each call (the cache left cold and clean; as long a
pass as `benches/decode.rs` makes, which hides a call's host work from the timing) and times
the call alone between CUDA events, the median of as many calls as fill 100 ms, as do_bench
does. `benches/decode.rs` takes the same flag. Backends: SDPA's (flash,
efficient, cudnn, math; `enable_gqa` where hkv < hq; with sq > 1 a bottom-right boolean mask,
which the flash backend refuses) and, where the `flash_attn` package is installed,
`flash_attn_with_kvcache` (row `flash-attn-kvcache`). A backend that refuses a shape prints a
`nan` row with the reason.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def ints(s):
    return [int(x) for x in s.split(",") if x]


def bench_read_clear(fn, warmup=25, rep=100):
    """do_bench's method (warm-up and repetitions by time, the call alone between events, the
    median) with a read-only pass over 1 GiB before each call instead of its zeroing."""
    buffer = torch.zeros(256 << 20, dtype=torch.float32, device="cuda")
    sums = torch.zeros((), dtype=torch.float32, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        sums += buffer.sum()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / 5
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    n = max(1, int(rep / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        sums += buffer.sum()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[n // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--b", default="1,8,64")
    p.add_argument("--sk", default="4096,16384,131072")
    p.add_argument("--hkv", default="32,8,4")
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--sq", type=int, default=1)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--backends", default="flash,efficient,cudnn,kvcache")
    p.add_argument("--max-cache-gib", type=float, default=32.0)
    p.add_argument("--clear", default="write", choices=["write", "read"])
    a = p.parse_args()
    if a.clear == "read":
        bench = bench_read_clear
    else:
        def bench(fn):
            return do_bench(fn, warmup=25, rep=100, return_mode="median")
    dtype, elem = torch.bfloat16, 2
    print("impl,dtype,b,hq,hkv,sq,sk,d,ms,gbps", flush=True)
    for hkv in ints(a.hkv):
        for b in ints(a.b):
            for sk in ints(a.sk):
                cache = 2 * b * hkv * sk * a.d * elem
                if cache / 2**30 > a.max_cache_gib:
                    print(f"# b {b} hkv {hkv} sk {sk}: cache over --max-cache-gib, skipped")
                    continue
                moved = cache + 2 * b * a.hq * a.sq * a.d * elem
                q = torch.randn(b, a.hq, a.sq, a.d, device="cuda", dtype=dtype)
                k = torch.randn(b, hkv, sk, a.d, device="cuda", dtype=dtype)
                v = torch.randn(b, hkv, sk, a.d, device="cuda", dtype=dtype)
                # Query i sees keys j <= i + sk - sq.
                mask = None
                if a.sq > 1:
                    i = torch.arange(a.sq, device="cuda")[:, None]
                    j = torch.arange(sk, device="cuda")[None, :]
                    mask = j <= i + sk - a.sq
                for name in a.backends.split(","):
                    label = "flash-attn-kvcache" if name == "kvcache" else f"torch-{name}"
                    row = f"{label},bf16,{b},{a.hq},{hkv},{a.sq},{sk},{a.d}"
                    try:
                        if name == "kvcache":
                            from flash_attn import flash_attn_with_kvcache
                            # flash-attn takes [batch, seq, heads, dim], the cache full to sk.
                            qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                            ms = bench(lambda: flash_attn_with_kvcache(qt, kt, vt, causal=True))
                        else:
                            with sdpa_kernel(BACKENDS[name]):
                                ms = bench(lambda: F.scaled_dot_product_attention(
                                    q, k, v, attn_mask=mask, enable_gqa=hkv != a.hq))
                        print(f"{row},{ms:.4f},{moved / ms / 1e6:.1f}", flush=True)
                    except Exception as e:  # a backend that refuses a shape says so
                        print(f"{row},nan,nan  # {type(e).__name__}: {str(e)[:80]}", flush=True)
                del q, k, v
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
