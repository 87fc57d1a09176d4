"""CPU training with PyTorch: flashattn.torch.attention against SDPA at equal torch threads, in one
process, rounds of the variants interleaved:
  - step: a 2-layer transformer training step (B 4, S 256, d_model 256, 4 heads, causal; SGD);
  - attn: the attention alone, forward + backward into leaf tensors whose gradients accumulate
    (as a model's do: each backward ends with torch's own parallel adds, after which its OpenMP
    workers spin while the next call runs).
Variants: sdpa; ours (flashattn's CPU calls on torch's OpenMP threads, the default of
flashattn.torch); ours-pools (on the library's own thread pools, flashattn.torch.use_torch_threads
(False)). Medians of --steps timed calls after --warmup, best round's median per variant.
    OMP_NUM_THREADS=T python bench/cpu_train_step.py [--mode step,attn] [--variants sdpa,ours,ours-pools]
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import flashattn
import flashattn.torch as fat

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--mode", default="step,attn")
ap.add_argument("--variants", default="sdpa,ours,ours-pools")
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--warmup", type=int, default=5)
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()

torch.manual_seed(0)
B, S, Dm, H = args.batch, 256, 256, 4
on_torch_threads = fat.torch_threads_in_use()

sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
ours = lambda q, k, v: fat.attention(q, k, v, is_causal=True)  # noqa: E731


class Block(nn.Module):
    def __init__(s, attn):
        super().__init__()
        s.qkv = nn.Linear(Dm, 3 * Dm)
        s.o = nn.Linear(Dm, Dm)
        s.ff = nn.Sequential(nn.Linear(Dm, 4 * Dm), nn.GELU(), nn.Linear(4 * Dm, Dm))
        s.n1 = nn.LayerNorm(Dm)
        s.n2 = nn.LayerNorm(Dm)
        s.attn = attn

    def forward(s, x):
        q, k, v = s.qkv(s.n1(x)).view(B, S, 3, H, Dm // H).unbind(2)
        a = s.attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2).reshape(B, S, Dm)
        x = x + s.o(a)
        return x + s.ff(s.n2(x))


def make(mode, attn):
    if mode == "step":
        torch.manual_seed(0)
        m = nn.Sequential(Block(attn), Block(attn))
        x = torch.randn(B, S, Dm)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)

        def step():
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        return step
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, S, Dm // H, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(B, H, S, Dm // H, generator=g)
    return lambda: attn(q, k, v).backward(dout)


def use(variant):
    if on_torch_threads:
        fat.use_torch_threads(variant != "ours-pools")


variants = args.variants.split(",")
for mode in args.mode.split(","):
    fns = {v: make(mode, sdpa if v == "sdpa" else ours) for v in variants}
    best = {v: float("inf") for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            use(v)
            f = fns[v]
            for _ in range(args.warmup):
                f()
            ts = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            best[v] = min(best[v], statistics.median(ts))
    use("ours")
    print(f"{mode}: threads {torch.get_num_threads()}, B {B}: "
          + ", ".join(f"{v} {best[v] * 1e3:.2f} ms" for v in variants)
          + ("" if on_torch_threads else " (torch does not use OpenMP here: ours = ours-pools)"), flush=True)
