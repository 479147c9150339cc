#!/usr/bin/env python3
"""PyTorch's rate for the GPT example's generation: the same model shape (GPT-2 small over
bytes: 12 pre-norm blocks, d_model 768, 12 heads, MLP 4x, vocabulary 256, context 1024), bf16,
random weights, decoded the way `examples/gpt` decodes its sample: half a context of prompt run
once into preallocated key/value caches, then one byte a step at the next position, the logits'
softmax in f32 copied to the host and sampled there. Eager PyTorch, SDPA for the attention.

    python3 scripts/torch_gpt_generate.py [--steps 500] [--layers 12] [--d-model 768] ...

Prints one CSV line: impl,steps,tokens_per_s,median_step_ms.
"""
import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)
        self.norm2 = torch.nn.LayerNorm(d)
        self.mlp_in = torch.nn.Linear(d, 4 * d)
        self.mlp_out = torch.nn.Linear(4 * d, d)

    def forward(self, x, cache, start):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        heads = lambda t: t.view(b, n, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = heads(q), heads(k), heads(v)
        keys, values = cache
        keys[:, :, start : start + n] = k
        values[:, :, start : start + n] = v
        end = start + n
        a = F.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end], is_causal=n > 1
        )
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x))))


class Gpt(torch.nn.Module):
    def __init__(self, layers, d, heads, context, vocab=256):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, d)
        self.positions = torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, caches, start):
        n = tokens.shape[1]
        pos = torch.arange(start, start + n, device=tokens.device)
        x = self.tokens(tokens) + self.positions(pos)
        for block, cache in zip(self.blocks, caches):
            x = block(x, cache, start)
        # The head in f32, as the example computes it.
        return F.linear(self.norm(x).float(), self.head.weight.float())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=500)
    a = p.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    dev = "cuda"
    model = Gpt(a.layers, a.d_model, a.heads, a.context).to(dev, torch.bfloat16).eval()
    head_dim = a.d_model // a.heads
    window = a.context // 2
    steps = min(a.steps, a.context - window)

    def sample(logits):
        probs = torch.softmax(logits[0, -1], dim=0).cpu().tolist()
        u = rng.random()
        for i, p_ in enumerate(probs):
            u -= p_
            if u < 0:
                return i
        return len(probs) - 1

    times = []
    with torch.inference_mode():
        for _ in range(2):  # the first pass warms the allocator and the kernels up
            shape = (1, a.heads, a.context, head_dim)
            caches = [
                (torch.zeros(shape, device=dev, dtype=torch.bfloat16),
                 torch.zeros(shape, device=dev, dtype=torch.bfloat16))
                for _ in range(a.layers)
            ]
            prompt = torch.full((1, window), ord("\n"), device=dev, dtype=torch.long)
            token = sample(model(prompt, caches, 0))
            times = []
            for i in range(steps):
                started = time.perf_counter()
                inp = torch.tensor([[token]], device=dev)
                token = sample(model(inp, caches, window + i))
                times.append(time.perf_counter() - started)
    rate = len(times) / sum(times)
    print("impl,steps,tokens_per_s,median_step_ms")
    print(f"torch-eager-sdpa,{len(times)},{rate:.1f},{statistics.median(times) * 1e3:.3f}")


if __name__ == "__main__":
    main()
