"""rotary as a drop-in for a Hugging Face transformers Llama model.

Builds a small Llama model in code (random weights, nothing downloaded),
patches it with rotary.integrations.transformers.apply_rotary_to_model, and
prints
- the largest |logit| difference against the unpatched model (prefill and a
  greedy decode with the KV cache); in fp32 both are checked ('check: ... OK',
  exit status 1 otherwise: `make demo` runs it with --quick),
- the time of the RoPE part alone: transformers' rotary_emb (cos/sin for the
  batch) + apply_rotary_pos_emb in every layer, against our kernel in every
  layer, on the model's q/k shapes, timed with benchmarks/protocol.py: both
  once per round in a seeded shuffled order, medians over --rounds, CPU time
  / wall next to the ratio, one pass per --threads count, the ratio refused
  on a loaded machine (--allow-load prints it marked '*').

    PYTHONPATH=<dir holding the built rotary package> python examples/hf_drop_in.py [--device cuda] [--dtype bf16]
        [--threads 1,2] [--rounds 15] [--quick]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from protocol import add_protocol_args, check_load, ratio_cell, thread_passes, time_interleaved  # noqa: E402

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

import rotary  # noqa: E402
from rotary.integrations.transformers import apply_rotary_to_model, rotary_embedding_of, unpatch  # noqa: E402


# fp32 logits: max |patched - unpatched| allowed per unit of the largest
# logit: transformers' fp32 angles give ~3e-6 here (2.2e-5 at logits up to 7.3).
FP32_LOGIT_RTOL = 1e-4


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds of the RoPE comparison")
    parser.add_argument("--quick", action="store_true", help="--seq 64, 3 rounds: a smoke run")
    add_protocol_args(parser)
    args = parser.parse_args()
    if args.quick:
        args.seq, args.rounds = 64, 3
    guard = check_load(args)
    print(guard.header())
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096, initializer_range=0.1,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 500000.0},
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(device)
    ids = torch.randint(0, config.vocab_size, (2, args.seq), device=device)
    gen_kw = dict(max_new_tokens=16, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)

    with torch.no_grad():
        fp32 = model(input_ids=ids).logits.float()  # the reference for 16-bit runs
        model.to(dtype)
        ref = model(input_ids=ids).logits.float()
        ref_gen = model.generate(input_ids=ids[:, :32], **gen_kw)

        apply_rotary_to_model(model)
        out = model(input_ids=ids).logits.float()
        gen = model.generate(input_ids=ids[:, :32], **gen_kw)
    print(f"model: Llama, {config.num_hidden_layers} layers, head_dim {config.head_dim}, "
          f"{config.num_attention_heads}/{config.num_key_value_heads} q/kv heads, llama3 rope, "
          f"{args.dtype} on {device}")
    print(f"patched: {rotary_embedding_of(model)}")
    diff, top = (out - ref).abs().max().item(), ref.abs().max().item()
    print(f"prefill [2, {args.seq}]: max |logit diff| vs unpatched = {diff:.3e} "
          f"(logits up to {top:.2f}; transformers forms angles in fp32, "
          f"~3.5e-8 rad per position of error, ours in float64)")
    if dtype != torch.float32:
        print(f"  mean |logit diff| vs the fp32 model: transformers {(ref - fp32).abs().mean().item():.3e}, "
              f"rotary {(out - fp32).abs().mean().item():.3e} (16-bit rounding, amplified by the layers)")
    same = (gen == ref_gen)[:, 32:].all(0).long().cumprod(0).sum().item()
    print(f"greedy decode with KV cache: first {same} of 16 new tokens identical in both rows")
    # fp32 only: 16-bit models round differently by design (see above), so
    # their tokens may part after a near-tie; that is reported, not failed.
    failed = False
    if dtype == torch.float32:
        tol = FP32_LOGIT_RTOL * max(1.0, top)
        checks = [(f"prefill logits equal the unpatched model's to fp32 rounding (max |diff| {diff:.1e} <= "
                   f"{tol:.1e})", diff <= tol),
                  (f"greedy tokens equal the unpatched model's ({same}/16 new tokens, both rows)", same == 16)]
        for what, ok in checks:
            print(f"check: {what}: {'OK' if ok else 'FAILED'}")
            failed |= not ok

    # The RoPE part alone, on this model's q/k shapes, for all layers.
    rope = rotary_embedding_of(model)
    unpatch(model)
    hd, layers = config.head_dim, config.num_hidden_layers
    q = torch.randn(2, config.num_attention_heads, args.seq, hd, device=device, dtype=dtype)
    k = torch.randn(2, config.num_key_value_heads, args.seq, hd, device=device, dtype=dtype)
    pos = torch.arange(args.seq, device=device)[None]
    hf_emb = model.model.rotary_emb

    def hf_rope():
        cos, sin = hf_emb(q, pos)
        for _ in range(layers):
            modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)

    def our_rope():
        for _ in range(layers):
            rotary.apply_rope_qk(q, k, rope.freqs, 0, False, position_ids=pos, inv_freq=rope.inv_freq)

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    variants = {"transformers": hf_rope, "rotary": our_rope}
    with torch.no_grad():
        for nt in thread_passes([None] if device.type == "cuda" else args.threads):
            st = time_interleaved(variants, args.rounds, warmup=3, seed=args.seed, sync=sync)
            t_hf, t_ours = st["transformers"].median, st["rotary"].median
            where = "" if nt is None else f", {nt} thread(s)"
            print(f"RoPE per forward ({layers} layers{where}, median of {args.rounds} interleaved rounds): "
                  f"transformers {t_hf * 1e3:.3f} ms, rotary {t_ours * 1e3:.3f} ms, "
                  f"ratio {ratio_cell(st['transformers'], st['rotary'], guard)}{guard.marker()}")
    print(guard.finish())
    if failed:
        raise SystemExit("hf_drop_in: the patched model differs from the unpatched one (see 'check:' above)")


if __name__ == "__main__":
    main()
