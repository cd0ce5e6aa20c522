#!/usr/bin/env python3
"""A transformers model patched with rotary against the same model unpatched,
at prefill (or, with --decode, one decode step on a KV cache of --seq
tokens), timed with benchmarks/protocol.py (every case once per round in a
seeded shuffled order, medians, CPU time / wall next to each ratio, one pass
per --threads count, refused on a loaded machine):

  unpatched  the model's own forward (cos/sin tables, rotate_half)
  patched    the same weights, rotary.integrations.transformers applied

Families: llama (plain), qwen3 (q/k norm before the rotation), gemma3_text
(one rule per layer type) and deepseek_v3 (MLA: the trailing rope dims of each
head, interleaved). Logits are checked equal before timing.

Usage: PYTHONPATH=python python benchmarks/bench_hf.py [--seq 2048] [--layers 2]
       [--hidden 1024] [--dtype fp32] [--repeat 15] [--threads 1,2] [--decode] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol import add_protocol_args, check_load, ratio_cell, thread_passes, time_interleaved  # noqa: E402

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(family: str, hidden: int, layers: int, seq: int, dtype: torch.dtype):
    import transformers

    heads, head_dim = hidden // 128 or 1, 128 if hidden >= 128 else hidden
    common = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=head_dim,
                  vocab_size=1024, max_position_embeddings=2 * seq)
    config = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(**common, sliding_window=seq),
        # MLA ([nope | rope] heads, interleaved pairs; the rotary module is sized by head_dim), dense layers.
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": heads, "head_dim": 64}, kv_lora_rank=hidden // 2, q_lora_rank=hidden,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=layers),
    }[family]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "gemma3_text": transformers.Gemma3ForCausalLM, "deepseek_v3": transformers.DeepseekV3ForCausalLM}[family]
    return cls(config).eval().to(dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="llama,qwen3,gemma3_text,deepseek_v3")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--decode", action="store_true",
                    help="time one decode step (batch --batch, one token each) on a KV cache of --seq tokens")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="one tiny case, no timing claims")
    add_protocol_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.seq, args.hidden, args.layers, args.repeat, args.threads = 32, 128, 1, 2, [1]
    guard = check_load(args)
    warnings.filterwarnings("ignore")
    from rotary.integrations.transformers import apply_rotary_to_model

    dtype = DTYPES[args.dtype]
    print(guard.header())
    for family in args.families.split(","):
        plain = build(family, args.hidden, args.layers, args.seq, dtype)
        patched = apply_rotary_to_model(copy.deepcopy(plain))
        ids = torch.randint(3, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
        step = ids[:, :1]
        caches = {}

        @torch.no_grad()
        def run(model):
            if not args.decode:
                return model(input_ids=ids).logits
            # One token past a prefilled static cache of --seq + 1 slots: every
            # step writes the same last slot, so each call sees the same cache.
            if id(model) not in caches:
                from transformers import StaticCache

                cache = StaticCache(config=model.config, max_cache_len=args.seq + 1)
                model(input_ids=ids, past_key_values=cache, use_cache=True)
                caches[id(model)] = cache
            cache = caches[id(model)]
            out = model(input_ids=step, past_key_values=cache, use_cache=True,
                        position_ids=torch.full_like(step, args.seq)).logits
            for layer in cache.layers:  # the step's slot is written again next call
                layer.cumulative_length.fill_(args.seq)
            return out

        # Same results first (the speed of a wrong answer is not a number).
        # 16-bit logits of a whole model drift apart: there the patched model
        # must be as near the float64 model as the unpatched one is.
        if dtype == torch.float32:
            torch.testing.assert_close(run(patched), run(plain), rtol=1e-4, atol=1e-4)
        else:
            wide = copy.deepcopy(plain).double()  # held: run() keys its caches by id(model)
            exact = run(wide)
            err = {name: float((run(m).double() - exact).abs().mean()) for name, m in (("patched", patched),
                                                                                         ("unpatched", plain))}
            if err["patched"] > 1.5 * err["unpatched"] + 2**-8 * float(exact.abs().mean()):
                raise SystemExit(f"bench_hf: {family} patched logits are further from float64 than unpatched: {err}")
        cases = {"unpatched": lambda: run(plain), "patched": lambda: run(patched)}
        for nt in thread_passes(args.threads):
            st = time_interleaved(cases, args.repeat, calls=None if args.decode else 1, warmup=2 if args.decode else 1,
                                  seed=args.seed, target_s=0.05)
            what = f"decode step (batch {args.batch}, cache of" if args.decode else "prefill (S="
            print(f"\n# {family} {what} {args.seq}), cpu, {args.dtype}, hidden {args.hidden}, "
                  f"{args.layers} layers, threads {torch.get_num_threads()}, {args.repeat} rounds, "
                  f"torch {torch.__version__}{guard.marker()}")
            print(f"{'case':<12}{'median ms':>12} {'x unpatched':>32}")
            for name, s in st.items():
                print(f"{name:<12}{s.median * 1e3:>12.2f} {ratio_cell(s, st['unpatched'], guard, 3):>32}")
    print("\n" + guard.finish())


if __name__ == "__main__":
    main()
