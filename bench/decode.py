#!/usr/bin/env python3
"""KV-cache decoding on a CUDA GPU: flashattn_forward_kvcache against the device's memory
bandwidth and PyTorch SDPA (every backend that takes the call; the best is the bar) on the same
contiguous cache, in the same process.

Shapes: one new query token per sequence (Sq = 1), GQA --heads (32/8), head dim --head-dim (128),
--dtype (bfloat16), cache lengths --cache-lens (4k..128k, every row valid), batch --batches
(1..64). A decoding step reads the whole cache once: bytes = B * S * Hkv * D * 2 (K and V) *
element size (q and out are negligible), so its bandwidth is bytes / time.
The bar is the device copy measured in the same run: torch's copy of a --copy-gib buffer into
another (read + write: 2 * size / time), the GPU's attainable bandwidth; the issue's target is
flashattn >= 80% of it. flashattn rows:
  flashattn        the library's split-KV choice (num_splits = 0)
  flashattn-nosplit  num_splits = 1 (one CTA per (sequence, kv head)): what the split buys
  flashattn-append   with a one-token append and rotary embedding (the full decoding step: the
                   prepare pass, then the attention)
  flashattn[L:S]   with --loaders: the same call with K/V loader L forced (bulk, rows, generic) and,
                   where given (rows:3), S pipeline stages (2, 3, 4)
  flashattn[streams=N]  with --streams: the split rule aiming at N whole-tile CTAs per SM
                   (FLASHATTN_CUDA_DECODE_STREAMS; the default counts them from the memory's bandwidth)
  base:flashattn[...]  with --base-lib: another build of the library (a change's base), same calls
  flashattn[seqlens]  passing cache_seqlens (checked on the device; [.., host-check] read on the host)
SDPA gets the same cache as [B, Hkv, S, D] views (no copy) with enable_gqa; sdpa-<backend> rows for
flash, cuDNN, efficient and math where they run. Each timed in two views (bench/attn_harness):
kernel (host hidden behind a GPU spin) and host-inclusive (from an idle GPU; flashattn's
includes the host's part of the call). Medians of --reps; a case's entries
are timed in --rounds (2) interleaved rounds, and each view keeps its best round.
Outputs: OUT/decode.csv, OUT/decode.md (also printed).

usage: python bench/decode.py --lib build/src/libflashattn.so --out DIR [--quick]
"""

import argparse
import contextlib
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_harness as H  # noqa: E402
from cabi import MASK_NONE, CtypesLib, EnvSettings  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", default="32,8", help="Hq,Hkv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-lens", default="4096,16384,65536,131072")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--max-gib", type=float, default=40.0, help="skip shapes whose caches exceed this")
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="--reps 10, --warmup 3, fewer shapes")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--host-check", action="store_true",
                    help="also time the calls with cache_seqlens with the index arrays read on the host "
                         "(FLASHATTN_CUDA_KV_CHECK=host; developer builds) instead of checked on the stream: "
                         "rows flashattn[seqlens, host-check] and flashattn-append[host-check]")
    ap.add_argument("--rounds", type=int, default=2,
                    help="interleaved rounds over a case's entries; each view keeps its best round's median")
    ap.add_argument("--loaders", default="",
                    help="also time the KV-cache kernel with each of these K/V loaders, each optionally with a "
                         "stage count (bulk,rows,generic,rows:3: FLASHATTN_CUDA_DECODE_LOADER and "
                         "FLASHATTN_CUDA_DECODE_STAGES; developer builds), rows flashattn[LOADER:STAGES]")
    ap.add_argument("--streams", default="",
                    help="also time the call with the split rule aiming at each of these CTA counts per SM "
                         "(1,2: FLASHATTN_CUDA_DECODE_STREAMS; developer builds), rows flashattn[streams=N]")
    ap.add_argument("--base-lib", default="",
                    help="also time another build of the library (e.g. the commit before a change) in the same "
                         "process and rounds: rows base:flashattn and base:flashattn[seqlens]")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.warmup = 10, 3
        args.cache_lens, args.batches = "4096,32768,131072", "1,16,64"
    import torch
    import torch.nn.functional as F

    H.ensure_dir(args.out)
    lib = CtypesLib(os.path.abspath(args.lib), torch)
    base = CtypesLib(os.path.abspath(args.base_lib), torch) if args.base_lib else None
    dtype = getattr(torch, args.dtype)
    hq, hkv = (int(x) for x in args.heads.split(","))
    d = args.head_dim
    es = torch.tensor([], dtype=dtype).element_size()
    timer = H.Timer(cuda=True)
    rows = []

    def timed(fn):
        return H.time_views(fn, args.warmup, args.reps, timer)

    # The bar: a device-to-device copy.
    n = int(args.copy_gib * 2**30) // 4
    src, dst = torch.empty(n, device="cuda", dtype=torch.float32), torch.empty(n, device="cuda", dtype=torch.float32)
    src.fill_(1.0)
    t = timed(lambda: dst.copy_(src))
    copy_gbs = 2 * n * 4 / t["kernel"] / 1e6
    del src, dst
    print(f"device copy: {copy_gbs:.0f} GB/s ({args.copy_gib} GiB, read + write)", flush=True)
    rows.append(dict(case=f"copy {args.copy_gib} GiB", impl="device-copy", kernel_ms=t["kernel"], host_ms=t["host"],
                     gbs_kernel=copy_gbs, gbs_host=2 * n * 4 / t["host"] / 1e6))

    for s in [int(x) for x in args.cache_lens.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            nbytes = 2 * b * s * hkv * d * es
            if nbytes > args.max_gib * 2**30:
                continue
            case = f"B{b} S{s // 1024}k"
            print(f"== {case} ({nbytes / 2**30:.2f} GiB of cache)", flush=True)
            g = torch.Generator(device="cuda").manual_seed(1)
            kc = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g)
            vc = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g)
            q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype, generator=g)
            out = torch.empty_like(q)
            lse = torch.empty(b, hq, 1, device="cuda")
            seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")

            # Every entry of the case is timed in --rounds interleaved rounds, and each view keeps its
            # best round's median: the first timing after a case's allocation can run slow (B16 4k:
            # 107 us against 92 us for the same plan timed next), whichever entry comes first.
            entries = []  # (name, fn, context factory)

            def record(name, fn, ctx=contextlib.nullcontext):
                entries.append((name, fn, ctx))

            opts = (MASK_NONE, 0, False)
            for name, splits in (("flashattn", 0), ("flashattn-nosplit", 1)):
                fn = lib.bind_forward_kvcache(q, kc, vc, out, lse, {"num_splits": splits}, opts)
                fn()
                record(name, fn)

            if base is not None:  # (its own copy of the library: separate plans and state)
                for name, extra in (("base:flashattn", {}), ("base:flashattn[seqlens]", {"cache_seqlens": seqlens})):
                    fn = base.bind_forward_kvcache(q, kc, vc, out, lse, {"num_splits": 0, **extra}, opts)
                    fn()
                    record(name, fn)

            # Variants under developer knobs (cabi.EnvSettings: set for the with-block, then back).
            def knobs(**kv):
                return functools.partial(EnvSettings, {f"FLASHATTN_CUDA_{k.upper()}": v for k, v in kv.items()})

            for variant in [x for x in args.loaders.split(",") if x]:
                loader, _, stages = variant.partition(":")
                fn = lib.bind_forward_kvcache(q, kc, vc, out, lse, {"num_splits": 0}, opts)
                env = knobs(decode_loader=loader, decode_stages=stages or None)
                with env():
                    fn()
                record(f"flashattn[{variant}]", fn, env)
            for n in [x for x in args.streams.split(",") if x]:
                fn = lib.bind_forward_kvcache(q, kc, vc, out, lse, {"num_splits": 0}, opts)
                env = knobs(decode_streams=n)
                with env():
                    fn()
                record(f"flashattn[streams={n}]", fn, env)

            check_env = knobs(kv_check="host")
            # With cache_seqlens (every row valid: the same attention), which the plain rows leave out,
            # as every decoding step passes it: checked on the stream (the default), and with
            # --host-check read on the host.
            for name, env in (("flashattn[seqlens]", contextlib.nullcontext),
                              ("flashattn[seqlens, host-check]", check_env)):
                if env is check_env and not args.host_check:
                    continue
                fn = lib.bind_forward_kvcache(q, kc, vc, out, lse, {"num_splits": 0, "cache_seqlens": seqlens}, opts)
                with env():
                    fn()
                record(name, fn, env)
            ref = out.clone()
            # The full step: append one token (rotated) at row s - 1, the last, then attend.
            kn, vn = (torch.randn(b, 1, hkv, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
            ang = torch.arange(s, device="cuda", dtype=torch.float32)[:, None] * torch.pow(
                10000.0, -torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)[None]
            cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
            before = seqlens - 1
            fn = lib.bind_forward_kvcache(q, kc, vc, out, lse, {"k_new": kn, "v_new": vn, "cache_seqlens": before,
                                                                "rotary_cos": cos, "rotary_sin": sin}, opts)
            fn()
            record("flashattn-append", fn)
            if args.host_check:
                with check_env():
                    fn()
                record("flashattn-append[host-check]", fn, check_env)

            if not args.no_sdpa:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                sq, sk, sv = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
                for name, be in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                                 ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa-math", SDPBackend.MATH)):
                    if name == "sdpa-math" and nbytes > 2**30:
                        continue  # (materialises the scores: slow and memory-hungry at long caches)
                    try:
                        with sdpa_kernel([be]):
                            o = F.scaled_dot_product_attention(sq, sk, sv, enable_gqa=True)
                            torch.cuda.synchronize()

                        def sfwd():
                            F.scaled_dot_product_attention(sq, sk, sv, enable_gqa=True)

                        record(name, sfwd, functools.partial(sdpa_kernel, [be]))
                        err = (o.transpose(1, 2).float() - ref.float()).abs().max().item()
                        if err > 0.05:
                            print(f"   {name}: differs from flashattn by {err:.3g}")
                    except Exception as e:
                        print(f"   {name}: not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                    torch.cuda.synchronize()
            best_t = {}
            for _ in range(args.rounds):
                for name, fn, ctx in entries:
                    with ctx():
                        t = timed(fn)
                    prev = best_t.get(name)
                    best_t[name] = t if prev is None else {v: min(prev[v], t[v]) for v in t}
            for name, _, _ in entries:
                t = best_t[name]
                rows.append(dict(case=case, impl=name, kernel_ms=t["kernel"], host_ms=t["host"],
                                 gbs_kernel=nbytes / t["kernel"] / 1e6, gbs_host=nbytes / t["host"] / 1e6))
            del kc, vc
            torch.cuda.empty_cache()

    H.write_csv(os.path.join(args.out, "decode.csv"), rows)
    lines = [f"# KV-cache decoding, {args.dtype}, Hq/Hkv {hq}/{hkv}, D {d}, Sq 1; GB/s of cache read "
             f"(device copy {copy_gbs:.0f} GB/s)", "",
             "| case | impl | kernel us | GB/s kernel | % of copy | GB/s host | best SDPA / this (kernel) |",
             "|---|---|---|---|---|---|---|"]
    best = {}
    for r in rows:
        if r["impl"].startswith("sdpa"):
            best[r["case"]] = min(best.get(r["case"], float("inf")), r["kernel_ms"])
    for r in rows:
        ratio = best[r["case"]] / r["kernel_ms"] if r["case"] in best else float("nan")
        lines.append(f"| {r['case']} | {r['impl']} | {1e3 * r['kernel_ms']:.1f} | {r['gbs_kernel']:.0f} | "
                     f"{100 * r['gbs_kernel'] / copy_gbs:.0f}% | {r['gbs_host']:.0f} | {ratio:.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "decode.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
