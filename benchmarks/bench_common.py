"""What the benchmark scripts share: the cases, the eager references (the
peers ours is checked against before it is timed), the device sync, the
kernel peers that are imported or loaded when present (Liger, FlashInfer),
and build_peers, the timed callables of one case."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from typing import Callable, Dict, Tuple

import torch


DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_shape: Tuple[int, int, int, int]
    k_shape: Tuple[int, int, int, int]
    decode: bool = False
    # q and k as the HF attention hands them over: [B, S, H, D] in memory,
    # seen as BHSD by a transpose (the kernel walks it token by token).
    hf_layout: bool = False


CPU_CASES = [
    Case("prefill", (1, 32, 4096, 128), (1, 8, 4096, 128)),
    Case("prefill_hf", (1, 32, 4096, 128), (1, 8, 4096, 128), hf_layout=True),
    Case("training", (4, 32, 1024, 128), (4, 32, 1024, 128)),
    Case("decode", (64, 32, 1, 128), (64, 8, 1, 128), decode=True),
    # Not in the default list: chunked prefill in the HF layout, whose data
    # sits in the last-level cache (bf16: 5 and 20 MiB of output).
    Case("prefill_512_hf", (1, 32, 512, 128), (1, 8, 512, 128), hf_layout=True),
    Case("prefill_2k_hf", (1, 32, 2048, 128), (1, 8, 2048, 128), hf_layout=True),
]
# GPU: the large cases run in both layouts, both pairings, out of place and in
# place (see run_cuda); decode is timed against one torch.add launch.
CUDA_CASES = [
    Case("prefill", (1, 32, 8192, 128), (1, 8, 8192, 128)),
    Case("training", (8, 32, 2048, 128), (8, 32, 2048, 128)),
    Case("long", (1, 64, 32768, 128), (1, 8, 32768, 128)),
    Case("decode", (64, 32, 1, 128), (64, 8, 1, 128), decode=True),
]
QUICK_CASE = Case("quick", (1, 4, 64, 64), (1, 2, 64, 64))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# References (the peers). They take the complex64 table `freqs` [max_seq, D/2].


def reference_rope(x: torch.Tensor, freqs: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
    """The reference formula: complex multiply via view_as_complex, fp32 math."""
    batch, n_head, seq_len, head_dim = x.shape
    seq_freqs = freqs[start_pos : start_pos + seq_len]
    x_complex = torch.view_as_complex(x.float().reshape(batch, n_head, seq_len, -1, 2))
    x_rotated = x_complex * seq_freqs.unsqueeze(0).unsqueeze(0)
    return torch.view_as_real(x_rotated).reshape(batch, n_head, seq_len, head_dim).type_as(x)


def reference_rope_qk(q, k, freqs, start_pos: int = 0):
    return reference_rope(q, freqs, start_pos), reference_rope(k, freqs, start_pos)


def float64_rope(x: torch.Tensor, start_pos: int, interleaved: bool, theta: float = 1e4) -> torch.Tensor:
    """The rotation from its formula, in float64 (no table): what every timed
    variant is checked against before timing."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(start_pos, start_pos + x.shape[-2], dtype=torch.float64)[:, None] * inv
    c, s, x = angle.cos(), angle.sin(), x.double().cpu()
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : d // 2], x[..., d // 2 :])
    ra, rb = a * c - b * s, a * s + b * c
    return torch.stack((ra, rb), -1).flatten(-2) if interleaved else torch.cat((ra, rb), -1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope_qk(q, k, cos, sin):
    """Hugging Face apply_rotary_pos_emb with cos/sin [S, D] in x's dtype."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def hf_tables(freqs: torch.Tensor, seq: int, dtype: torch.dtype, start_pos: int = 0):
    f = freqs[start_pos : start_pos + seq]
    cos = torch.cat((f.real, f.real), dim=-1).to(dtype).contiguous()
    sin = torch.cat((f.imag, f.imag), dim=-1).to(dtype).contiguous()
    return cos, sin


# --------------------------------------------------------------------------
# Timing


class Timer:
    """The device's sync, for the protocol's wall-clock samples."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()



def case_bytes(case: Case, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in case.q_shape:
        n *= s
    m = 1
    for s in case.k_shape:
        m *= s
    return 2 * (n + m) * elem


def fmt_time(s: float) -> str:
    if s >= 1e-1:
        return f"{s * 1e3:.1f} ms"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


# --------------------------------------------------------------------------
# Kernel peers, when present


def switched_off(fn: Callable[[], object], switch: str) -> Callable[[], object]:
    """fn with one of the CUDA launches' switches (rotary._C._cuda_set_<switch>)
    off: the launch reads it on the host, call by call (and a CUDA graph as
    it is captured), so both time in the same interleaved rounds."""
    import rotary

    setter = getattr(rotary._C, f"_cuda_set_{switch}")

    def run():
        prior = setter(False)
        try:
            return fn()
        finally:
            setter(prior)
    return run


def without_l2_prefetch(fn: Callable[[], object]) -> Callable[[], object]:
    """fn with the L2 prefetch of next rows switched off."""
    return switched_off(fn, "l2_prefetch")


def without_copy_blocks(fn: Callable[[], object]) -> Callable[[], object]:
    """fn with the fused KV-cache launch's copy blocks switched off (the rope
    rows copy v after their rotation)."""
    return switched_off(fn, "copy_blocks")


def liger_fn():
    """(Liger's rope function, None) or (None, why not): an import that fails
    (not the wheel's absence) is named, not shown as "not installed"."""
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ModuleNotFoundError as e:
        return None, "not installed" if e.name and e.name.startswith("liger_kernel") else f"import failed: {e}"
    except Exception as e:  # noqa: BLE001 (reported in the table's notes)
        return None, f"import failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return liger_rotary_pos_emb, None



# benchmarks/peers/build_flashinfer.py builds it on a machine with network.
FLASHINFER_LIB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".peers", "lib",
                              "rotary_flashinfer_peer.so")


@functools.lru_cache(maxsize=None)  # loaded once per process, not once per row
def flashinfer_ops():
    """torch.ops.rotary_peers (FlashInfer's RoPE kernels: flashinfer_peer.cu),
    or None with the reason when it is not built or does not load."""
    if not os.path.exists(FLASHINFER_LIB):
        return None, "not built (benchmarks/peers/build_flashinfer.py)"
    try:
        torch.ops.load_library(FLASHINFER_LIB)
    except Exception as e:  # noqa: BLE001 (a peer that does not load is named, not fatal)
        return None, f"does not load: {type(e).__name__}: {str(e)[:120]}"
    return torch.ops.rotary_peers, ""


def flashinfer_table(freqs: torch.Tensor) -> torch.Tensor:
    """FlashInfer's cos_sin_cache [positions, rotary_dim] float32 (cos, then
    sin) from a complex64 table [positions, rotary_dim / 2]."""
    return torch.cat((freqs.real, freqs.imag), dim=-1).float().contiguous()


# --------------------------------------------------------------------------
# Peers for one case


def try_compile(fn, device: str):
    try:
        import torch._dynamo  # noqa: F401

        return torch.compile(fn, dynamic=False, fullgraph=False)
    except Exception as e:  # pragma: no cover - depends on the toolchain
        log(f"  torch.compile unavailable: {e!r}")
        return None


def build_peers(
    case: Case, dtype: torch.dtype, device: str, compile_refs: bool
) -> Tuple[Dict[str, Callable[[], object]], Dict[str, str]]:
    """Returns ({name: fn}, {name: note}). Also checks that ours agrees with
    the references, so a wrong kernel can never post a good time."""
    import rotary  # noqa: F401  (registers torch.ops.rotary)

    gen = torch.Generator(device="cpu").manual_seed(0)
    def draw(shape):
        b, h, s, d = shape
        if case.hf_layout:
            x = torch.randn((b, s, h, d), generator=gen, dtype=torch.float32).transpose(1, 2)
        else:
            x = torch.randn(shape, generator=gen, dtype=torch.float32)
        return x.to(device=device, dtype=dtype)

    q, k = draw(case.q_shape), draw(case.k_shape)
    seq, head_dim = case.q_shape[2], case.q_shape[3]
    start_pos = 7 if case.decode else 0
    freqs = rotary.freqs_table(head_dim, start_pos + seq).to(device)
    cos, sin = hf_tables(freqs, seq, dtype, start_pos)
    op = torch.ops.rotary.apply_rope_qk

    fns: Dict[str, Callable[[], object]] = {}
    notes: Dict[str, str] = {}
    fns["clone"] = lambda: (q.clone(), k.clone())
    if case.decode:
        fns["add"] = lambda: (torch.add(q, q), torch.add(k, k))
    fns["ours"] = lambda: op(q, k, freqs, start_pos, True)
    fns["ours_half"] = lambda: op(q, k, freqs, start_pos, False)
    # In place rotates q and k again on every call; a rotation keeps their norms.
    qi, ki = q.clone(), k.clone()
    fns["ours_"] = lambda: torch.ops.rotary.apply_rope_qk_(qi, ki, freqs, start_pos, True)
    fns["reference"] = lambda: reference_rope_qk(q, k, freqs, start_pos)
    fns["rotate_half"] = lambda: hf_rope_qk(q, k, cos, sin)

    # Correctness first, against the formula in float64 (bf16 tolerances
    # cover the peers' bf16 math).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype in (torch.float32, torch.float64) else dict(atol=5e-2, rtol=2e-2)
    exact = {pairing: (float64_rope(q, start_pos, pairing), float64_rope(k, start_pos, pairing))
             for pairing in (True, False)}
    for name, interleaved in (("ours", True), ("reference", True), ("ours_half", False), ("rotate_half", False)):
        for got, want in zip(fns[name](), exact[interleaved]):
            torch.testing.assert_close(got.double().cpu(), want, **tol, msg=lambda m, n=name: f"{n}: {m}")
    ref = reference_rope_qk(q, k, freqs, start_pos)
    half = hf_rope_qk(q, k, cos, sin)
    fns["ours_"]()  # the first in-place call must give exactly the out-of-place result
    for got, want in zip((qi, ki), fns["ours"]()):
        assert torch.equal(got, want), "apply_rope_qk_ differs from apply_rope_qk"

    if compile_refs:
        c_reference = try_compile(reference_rope_qk, device)
        c_hf = try_compile(hf_rope_qk, device)
        for name, cfn, args, want in (
            ("compile(reference)", c_reference, (q, k, freqs, start_pos), ref),
            ("compile(rotate_half)", c_hf, (q, k, cos, sin), half),
        ):
            if cfn is None:
                continue
            log(f"  compiling {name} ...")
            t0 = time.perf_counter()
            try:
                for got, w in zip(cfn(*args), want):  # a wrong compiled result is not timed
                    torch.testing.assert_close(got, w, **tol)
            except Exception as e:  # pragma: no cover - depends on the toolchain
                log(f"  {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                notes[name] = "failed"
                continue
            log(f"  compiled {name} in {time.perf_counter() - t0:.1f} s")
            fns[name] = (lambda f=cfn, a=args: f(*a))

    if device == "cuda":
        liger, why = liger_fn()
        if liger is None:
            notes["liger"] = why
        else:
            # Liger wants cos/sin [1, S, D]; it rotates half (NeoX) pairs.
            lc, ls = cos.unsqueeze(0), sin.unsqueeze(0)
            try:  # checked like the compiled peers: a wrong result is a note, not a time
                for got, want in zip(liger(q.clone(), k.clone(), lc, ls), exact[False]):
                    torch.testing.assert_close(got.double().cpu(), want, **tol)
                fns["liger"] = lambda: liger(q, k, lc, ls)
            except AssertionError as e:
                notes["liger"] = f"wrong result: {str(e).splitlines()[0][:120]}"
    return fns, notes
