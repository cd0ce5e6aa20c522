"""Fused RoPE + KV-cache write against its baselines, all timed in one run.

Per shape, the median time of one step of:
  fused     rotary.apply_rope_with_kv_cache_ (q, k rotated in place; k, v into the cache)
  unfused   rotary.apply_rope_qk_ + two index_copy_ into the cache
  compiled  torch.compile(fullgraph=True) of the eager formula (rotate_half
            on a cos/sin table, in place) + two index_copy_
  compiled put  the same with index_put_ (cache[slots] = rows) instead, which
            Inductor writes in place (with index_copy_, a decode step here
            costs about as much as copying both caches)
  floor     the copy floor: copy_ of q+k+v bytes and of k bytes (reads and
            writes q + 2k + v, what the step must move at least)
q, k, v are token-major ([batch, seq, heads, head_dim], layout BSHD), as a
projection leaves them. Shapes: decode B=64, 32/8 heads, D=128, paged NHD
block 16 (one slot per sequence); prefill one sequence of S tokens into a
paged NHD cache and into a contiguous BHSD one.

    PYTHONPATH=python .venv/bin/python benchmarks/bench_kv_cache.py [--threads 2] [--dtype bfloat16] [--device cpu]
"""

import argparse
import statistics
import time

import torch

import rotary


def make(device, dtype, B, S, Hq, Hk, D, kv_layout, block, start):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, Hq, D, generator=g).to(device, dtype)
    k = torch.randn(B, S, Hk, D, generator=g).to(device, dtype)
    v = torch.randn(B, S, Hk, D, generator=g).to(device, dtype)
    if kv_layout == "NHD":
        blocks = B * ((start + S + block - 1) // block) + 8
        kc = torch.zeros(blocks, block, Hk, D, dtype=dtype, device=device)
        # each sequence owns a run of blocks; its tokens go at start .. start+S-1 within them
        per = (start + S + block - 1) // block
        slots = torch.stack([b * per * block + start + torch.arange(S) for b in range(B)]).reshape(-1).to(device)
        extra = dict(slot_mapping=slots, kv_layout="NHD")
    else:
        kc = torch.zeros(B, Hk, start + S, D, dtype=dtype, device=device)
        slots = torch.arange(start, start + S, device=device)
        extra = dict(kv_layout="BHSD")
    return q, k, v, kc, kc.clone(), slots, extra


def cases(device, dtype, B, S, Hq, Hk, D, kv_layout, block=16, start=100):
    q, k, v, kc, vc, slots, extra = make(device, dtype, B, S, Hq, Hk, D, kv_layout, block, start)
    f = rotary.freqs_table(D, start + S + 1).to(device)
    cos, sin = f.real.contiguous(), f.imag.contiguous()
    pos = torch.arange(start, start + S, device=device)

    def write_put(kc, vc, k, v):  # index_put_: Inductor writes it in place
        if kv_layout == "NHD":
            kc.view(-1, Hk, D)[slots] = k.reshape(-1, Hk, D)
            vc.view(-1, Hk, D)[slots] = v.reshape(-1, Hk, D)
        else:
            kc[:, :, slots] = k.transpose(1, 2)
            vc[:, :, slots] = v.transpose(1, 2)

    def write(kc, vc, k, v):
        if kv_layout == "NHD":
            kc.view(-1, Hk, D).index_copy_(0, slots, k.reshape(-1, Hk, D))
            vc.view(-1, Hk, D).index_copy_(0, slots, v.reshape(-1, Hk, D))
        else:
            kc.index_copy_(2, slots, k.transpose(1, 2))
            vc.index_copy_(2, slots, v.transpose(1, 2))

    def fused():
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, start, False, layout="BSHD", **extra)

    def unfused():
        rotary.apply_rope_qk_(q, k, f, start, False, layout="BSHD")
        write(kc, vc, k, v)

    def eager(q, k, v, kc, vc, put=False):
        c = cos[pos][None, :, None, :]
        s = sin[pos][None, :, None, :]
        for x in (q, k):
            x1, x2 = x[..., : D // 2].float(), x[..., D // 2 :].float()
            x.copy_(torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1))
        (write_put if put else write)(kc, vc, k, v)

    compiled_fn = torch.compile(eager, fullgraph=True, dynamic=False)
    compiled_put = torch.compile(lambda *a: eager(*a, put=True), fullgraph=True, dynamic=False)
    src = torch.empty(q.numel() + 2 * k.numel(), dtype=dtype, device=device)
    dst, src_k, dst_k = torch.empty_like(src), torch.empty_like(k), torch.empty_like(k)

    def floor():
        dst.copy_(src)
        dst_k.copy_(src_k)

    return {"fused": fused, "unfused": unfused, "compiled": lambda: compiled_fn(q, k, v, kc, vc),
            "compiled_put": lambda: compiled_put(q, k, v, kc, vc), "floor": floor}


def timeit(fns, device, rounds, calls):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = {n: [] for n in fns}
    for fn in fns.values():  # warm-up (compiles)
        for _ in range(3):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():  # interleaved, so drift hits every row alike
            sync()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times[name].append((time.perf_counter() - t) / calls * 1e6)
    return {n: statistics.median(v) for n, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefill", type=int, default=0, help="prefill tokens (default 2048 CPU, 8192 GPU)")
    ap.add_argument("--rounds", type=int, default=11)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    S = a.prefill or (8192 if a.device == "cuda" else 2048)
    shapes = [
        ("decode B=64 S=1 32/8 heads D=128, paged NHD 16", dict(B=64, S=1, kv_layout="NHD"), 200),
        (f"prefill B=1 S={S} 32/8 heads D=128, paged NHD 16", dict(B=1, S=S, kv_layout="NHD"), 5),
        (f"prefill B=1 S={S} 32/8 heads D=128, contiguous BHSD", dict(B=1, S=S, kv_layout="BHSD"), 5),
    ]
    where = f"{a.device}" + (f", {a.threads} thread(s)" if a.device == "cpu" else f", {torch.cuda.get_device_name()}")
    print(f"{a.dtype}, {where}, median of {a.rounds} rounds\n")
    print("| shape | fused us | unfused us | compiled us | compiled put us | floor us | fused/unfused "
          "| fused/compiled | fused/compiled put | fused/floor |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for title, kw, calls in shapes:
        t = timeit(cases(a.device, dtype, Hq=32, Hk=8, D=128, **kw), a.device, a.rounds, calls)
        f = t["fused"]
        print(f"| {title} | {f:.1f} | {t['unfused']:.1f} | {t['compiled']:.1f} | {t['compiled_put']:.1f} | "
              f"{t['floor']:.1f} | {f / t['unfused']:.2f} | {f / t['compiled']:.2f} | {f / t['compiled_put']:.2f} | "
              f"{f / t['floor']:.2f} |")


if __name__ == "__main__":
    main()
