// rotary demo: a tiny Llama-style decoder in LibTorch with a KV cache.
//
//   1. The paper's relative-position proof, run through rotary::RotaryEmbedding:
//      at a fixed offset the RoPE q.k score is the same at any absolute
//      position, the sinusoidal-add score drifts, and the RoPE score still
//      depends on the offset.
//   2. A 2-layer decoder (GQA, RMSNorm, SwiGLU, random weights) prefills 64
//      tokens and greedily decodes 64 more with a rotary::KVCache per layer,
//      filled by rope->forward_with_cache (q and k rotated and k, v appended
//      in one op). Every decode step is checked against a full recompute of
//      the whole sequence (no cache, start_pos 0); the program exits 1 if
//      they differ by more than kTolerance.
//   3. The time RoPE took in that run, against the reference formula (eager view_as_complex)
//      (view_as_complex multiply on a sliced table) on the same q/k shapes.
// Part 1 is demo_relative.h, the decoder demo_decoder.h; this file runs them.
#include "demo_common.h"
#include "demo_decoder.h"
#include "demo_relative.h"

#include <rotary/rotary.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

using namespace demo;

int main() {
  torch::NoGradGuard no_grad;
  const auto t_start = Clock::now();
  const bool tty = isatty(fileno(stdout));
  std::printf("rotary demo: LibTorch %d.%d.%d, %d CPU threads\n\n", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR,
              TORCH_VERSION_PATCH, at::get_num_threads());

  // ---- 1. relative position
  const bool relative_ok = relative_position_proof();

  // ---- 2. prefill + cached decode, each step checked against a full recompute
  constexpr int64_t kPrefill = 64, kDecode = 64;
  constexpr double kTolerance = 1e-4;  // fp32 logits; a real position bug is ~1e-1
  Config cfg;
  cfg.max_len = kPrefill + kDecode;
  torch::manual_seed(0);
  Decoder model(cfg);
  model->eval();
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  std::printf("[2/3] KV-cache decode: Llama-style decoder, %lld layers, %lld query / %lld kv heads (GQA), head_dim %lld,\n"
              "      hidden %lld, SwiGLU %lld, vocab %lld, %.2fM random fp32 weights (seed 0)\n",
              (long long)cfg.layers, (long long)cfg.heads, (long long)cfg.kv_heads, (long long)cfg.head_dim,
              (long long)cfg.hidden, (long long)cfg.ffn, (long long)cfg.vocab, params / 1e6);
  std::printf("      rope: %s\n", [&] {
    std::ostringstream os;
    model->rope->pretty_print(os);
    return os.str();
  }().c_str());

  auto tokens = torch::zeros({1, cfg.max_len}, torch::kLong);
  tokens.narrow(1, 0, kPrefill).copy_(torch::randint(cfg.vocab, {1, kPrefill}, torch::kLong));

  RopeClock clock;
  double generate_s = 0.0;  // the cached run: prefill + decode steps, less the timing extras
  auto caches = model->new_cache(1);
  clock.record = true;
  auto t0 = Clock::now();
  auto logits = model->forward(tokens.narrow(1, 0, kPrefill), 0, &caches, &clock);
  generate_s += seconds_since(t0) - std::exchange(clock.extra, 0.0);
  clock.record = false;
  std::printf("      prefill %lld tokens (causal mask, start_pos 0) into a [1, %lld, %lld, %lld] cache per layer: %.1f ms\n",
              (long long)kPrefill, (long long)cfg.kv_heads, (long long)cfg.max_len, (long long)cfg.head_dim,
              1e3 * generate_s);

  auto next = logits[0][-1].argmax();
  double max_diff = 0.0, max_logit = 0.0;
  int64_t agree = 0;
  std::vector<rotary::KVCache> before_last;
  Tensor last_logits;
  for (int64_t step = 0; step < kDecode; ++step) {
    const int64_t pos = kPrefill + step;
    tokens[0][pos] = next;
    if (step == kDecode - 1) {  // keep the cache for the control below
      for (const auto& kv : caches) {
        before_last.emplace_back(std::dynamic_pointer_cast<rotary::KVCacheImpl>(kv->clone()));
      }
    }
    clock.record = true;
    t0 = Clock::now();
    auto step_logits = model->forward(tokens.narrow(1, pos, 1), /*start_pos=*/pos, &caches, &clock)[0][-1];
    generate_s += seconds_since(t0) - std::exchange(clock.extra, 0.0);
    clock.record = false;

    // The whole sequence so far, no cache, start_pos 0.
    auto full_logits = model->forward(tokens.narrow(1, 0, pos + 1), 0)[0][-1];
    max_diff = std::max(max_diff, (step_logits - full_logits).abs().max().item<double>());
    max_logit = std::max(max_logit, full_logits.abs().max().item<double>());
    agree += step_logits.argmax().item<int64_t>() == full_logits.argmax().item<int64_t>();
    next = step_logits.argmax();
    last_logits = step_logits;

    if ((step + 1) % 8 == 0) {
      std::printf("%s      decode %2lld/%lld  position %3lld  max |cached - recompute| so far %.1e%s", tty ? "\r" : "",
                  (long long)(step + 1), (long long)kDecode, (long long)pos, max_diff, tty ? "" : "\n");
      std::fflush(stdout);
    }
  }
  if (tty) std::printf("\n");

  // Control: the last step again, from the same cache, rotated one position late.
  auto shifted = model->forward(tokens.narrow(1, kPrefill + kDecode - 1, 1), kPrefill + kDecode - 1, &before_last,
                                nullptr, /*rope_shift=*/1)[0][-1];
  const double control_diff = (shifted - last_logits).abs().max().item<double>();

  std::printf("      generated:");
  for (int64_t i = kPrefill; i < kPrefill + 12; ++i) std::printf(" %lld", (long long)tokens[0][i].item<int64_t>());
  std::printf(" ... (%lld tokens)\n", (long long)kDecode);
  const bool decode_ok = std::isfinite(max_diff) && max_diff <= kTolerance && agree == kDecode;
  std::printf("      cached decode vs full recompute over %lld steps: max |logit diff| %.2e (|logits| up to %.1f),\n"
              "      greedy tokens agree %lld/%lld; tolerance %.0e: %s\n",
              (long long)kDecode, max_diff, max_logit, (long long)agree, (long long)kDecode, kTolerance,
              decode_ok ? "PASS" : "FAIL");
  std::printf("      control: the same step rotated at start_pos + 1 differs by %.2e, so the check has teeth\n\n",
              control_diff);

  // ---- 3. RoPE time in the run vs the reference formula, same q/k
  std::printf("[3/3] RoPE time: rope->forward(q, k, start_pos) vs the reference formula (view_as_complex\n"
              "      multiply on the sliced table), both timed on the same q/k at every call of the run above\n");
  struct Case {
    const char* name;
    int64_t seq, start_pos;
    const RopeClock::Samples* in_run;
  };
  const Case cases[] = {{"prefill", kPrefill, 0, &clock.prefill}, {"decode", 1, kPrefill, &clock.decode}};
  for (const auto& cs : cases) {
    // The same shapes alone, round-robin, for the kernel's own time.
    auto q = torch::randn({1, cs.seq, cfg.heads, cfg.head_dim}).transpose(1, 2);
    auto k = torch::randn({1, cs.seq, cfg.kv_heads, cfg.head_dim}).transpose(1, 2);
    std::vector<double> ours, reference;
    for (int rep = 0; rep < 210; ++rep) {  // the first 10 are warm-up
      auto t = Clock::now();
      auto qk = model->rope->forward(q, k, cs.start_pos);
      const double a = seconds_since(t);
      t = Clock::now();
      auto q2 = reference_apply_rope(q, model->rope->freqs, cs.start_pos);
      auto k2 = reference_apply_rope(k, model->rope->freqs, cs.start_pos);
      const double b = seconds_since(t);
      if (rep >= 10) ours.push_back(a), reference.push_back(b);
    }
    const double run = median(cs.in_run->ours), run_reference = median(cs.in_run->reference);
    const std::string shapes = "q" + shape(q) + " k" + shape(k);
    std::printf("      %-7s %-24s in the run (median of %3zu): %5.1f us vs reference %5.1f us -> %.2fx\n"
                "      %-7s %-24s alone      (median of 200): %5.1f us vs reference %5.1f us -> %.2fx\n",
                cs.name, shapes.c_str(), cs.in_run->ours.size(), 1e6 * run, 1e6 * run_reference,
                run / run_reference, "", "", 1e6 * median(ours), 1e6 * median(reference), median(ours) / median(reference));
  }
  // Per-call medians times the run's call counts: one stray preemption does not swing the total.
  const auto calls = [](const RopeClock::Samples& s, size_t reps) { return static_cast<double>(s.ours.size() / reps); };
  const double n_prefill = calls(clock.prefill, RopeClock::kPrefillReps), n_decode = calls(clock.decode, 1);
  const double rope_total = n_prefill * median(clock.prefill.ours) + n_decode * median(clock.decode.ours);
  const double reference_total = n_prefill * median(clock.prefill.reference) + n_decode * median(clock.decode.reference);
  const bool same_output = clock.max_diff < 1e-5 && clock.fused_diff == 0.0;
  std::printf("      RoPE in the run: %.0f calls x median = %.2f ms of the %.1f ms cached generation (%.1f%%);\n"
              "      the reference formula: %.2f ms. rotary/reference = %.2fx; outputs %s\n",
              n_prefill + n_decode, 1e3 * rope_total, 1e3 * generate_s, 100.0 * rope_total / generate_s,
              1e3 * reference_total, rope_total / reference_total,
              clock.max_diff == 0.0 ? "bit-identical" : ("agree to " + std::to_string(clock.max_diff)).c_str());
  std::printf("      forward_with_cache (fused rotate + append) vs forward on the same q/k: %s\n\n",
              clock.fused_diff == 0.0 ? "bit-identical" : ("differ by " + std::to_string(clock.fused_diff)).c_str());

  const bool ok = relative_ok && decode_ok && same_output;
  std::printf("%s in %.1f s\n", ok ? "ALL CHECKS PASSED" : "FAILED", seconds_since(t_start));
  return ok ? 0 : 1;
}
