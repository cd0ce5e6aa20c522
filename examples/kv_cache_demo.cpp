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
#include <rotary/rotary.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <unistd.h>

namespace {

using torch::Tensor;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string shape(const Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? "," : "") + std::to_string(t.size(i));
  return s + "]";
}

// The reference formula (the paper's complex multiply), in plain torch ops: pairs (2j, 2j+1) as
// complex numbers, multiplied by rows start_pos .. start_pos+seq of the table.
Tensor reference_apply_rope(const Tensor& x, const Tensor& freqs, int64_t start_pos) {
  const int64_t b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  auto f = freqs.slice(0, start_pos, start_pos + s).unsqueeze(0).unsqueeze(0);
  auto xc = torch::view_as_complex(x.to(torch::kFloat).reshape({b, h, s, d / 2, 2}));
  return torch::view_as_real(xc * f).reshape({b, h, s, d}).type_as(x);
}

// ---------------------------------------------------------------------------
// Part 1: relative position, the paper's proof.

// The 2017 sinusoidal vector for one position: sin in even dims, cos in odd.
Tensor sinusoidal(int64_t pos, int64_t dim, double base) {
  auto i = torch::arange(dim / 2, torch::kFloat64);
  auto angle = pos * torch::pow(base, -2.0 * i / dim);
  auto pe = torch::empty({dim}, torch::kFloat64);
  pe.slice(0, 0, dim, 2).copy_(torch::sin(angle));
  pe.slice(0, 1, dim, 2).copy_(torch::cos(angle));
  return pe;
}

// One row of the usual fp32-angle table: angle pos * theta_j in float32.
Tensor fp32_angle_row(int64_t pos, int64_t dim, double base) {
  auto inv = 1.0 / torch::pow(base, torch::arange(0, dim, 2, torch::kFloat) / dim);
  auto angle = torch::full({1}, static_cast<float>(pos)) * inv;  // float32, as the usual tables do
  return torch::polar(torch::ones_like(angle), angle).unsqueeze(0);  // [1, dim/2]
}

bool relative_position_proof() {
  constexpr int64_t kDim = 64, kOffset = 2;
  constexpr double kBase = 10000.0;
  const std::vector<int64_t> starts = {2, 5, 9, 14, 20, 1000, 4000, 32768, 131072};

  torch::manual_seed(7);
  rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(kDim).max_seq_len(starts.back() + 1).theta(kBase));
  auto q = torch::randn({kDim}, torch::kFloat64);
  auto k = torch::randn({kDim}, torch::kFloat64);
  auto rotated = [&](const Tensor& v, int64_t pos) {
    return rope->forward(v.view({1, 1, 1, kDim}), pos).view({kDim});
  };
  auto fp32_rotated = [&](const Tensor& v, int64_t pos) {
    return reference_apply_rope(v.view({1, 1, 1, kDim}), fp32_angle_row(pos, kDim, kBase), 0).view({kDim});
  };

  std::printf("[1/3] Relative position: q.k at a fixed offset m - n = %lld, dim %lld\n",
              static_cast<long long>(kOffset), static_cast<long long>(kDim));
  std::printf("  %7s %7s  %12s  %15s  %15s\n", "m", "n", "rotary", "sinusoidal-add", "fp32-angle table");
  std::vector<double> r, a, s;
  for (int64_t m : starts) {
    const int64_t n = m - kOffset;
    r.push_back(torch::dot(rotated(q, m), rotated(k, n)).item<double>());
    a.push_back(torch::dot(q + sinusoidal(m, kDim, kBase), k + sinusoidal(n, kDim, kBase)).item<double>());
    s.push_back(torch::dot(fp32_rotated(q, m), fp32_rotated(k, n)).item<double>());
    std::printf("  %7lld %7lld  %12.8f  %15.8f  %15.8f\n", static_cast<long long>(m), static_cast<long long>(n),
                r.back(), a.back(), s.back());
  }
  std::vector<double> by_offset;
  for (int64_t d : {0, 1, 3, 6}) by_offset.push_back(torch::dot(rotated(q, 10 + d), rotated(k, 10)).item<double>());

  auto spread = [](const std::vector<double>& v) {
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    return *hi - *lo;
  };
  const double rope_spread = spread(r), add_spread = spread(a), fp32_spread = spread(s);
  const double offset_spread = spread(by_offset);
  std::printf("  spread over m: rotary %.1e (table rounding), sinusoidal-add %.4f (absolute position leaks),\n"
              "                 fp32-angle table %.1e (angle rounded in float32 at large m)\n",
              rope_spread, add_spread, fp32_spread);
  std::printf("  rotary score at offsets 0, 1, 3, 6: %.4f, %.4f, %.4f, %.4f (it does depend on the offset)\n",
              by_offset[0], by_offset[1], by_offset[2], by_offset[3]);
  const bool ok = std::isfinite(rope_spread) && rope_spread < 1e-5 && add_spread > 1e-3 && offset_spread > 1e-3;
  std::printf("  ROPE IS RELATIVE-POSITION INVARIANT: %s\n\n", ok ? "YES" : "NO");
  return ok;
}

// ---------------------------------------------------------------------------
// Part 2: a tiny Llama-style decoder.

struct Config {
  int64_t vocab = 512;
  int64_t hidden = 256;
  int64_t layers = 2;
  int64_t heads = 8;
  int64_t kv_heads = 2;
  int64_t head_dim = 32;
  int64_t ffn = 688;  // ~8/3 * hidden, as Llama
  int64_t max_len = 128;
  double theta = 10000.0;
  double eps = 1e-5;
};

// Times every rope->forward call of the cached run, and the reference formula's eager
// formula on the very same q and k right next to it; the order alternates so
// neither always finds the cache warmer. A prefill call (two per run, one
// per layer) is timed kPrefillReps times for a median.
struct RopeClock {
  static constexpr int kPrefillReps = 5;
  struct Samples {
    std::vector<double> ours, reference;  // seconds per call
  };
  bool record = false;
  Samples prefill, decode;
  double max_diff = 0.0;    // rotary vs the reference formula, over every timed call
  double fused_diff = 0.0;  // forward_with_cache vs forward, same q/k
  double extra = 0.0;     // time spent here beyond the run's own rotary calls
  int64_t turns = 0;

  std::tuple<Tensor, Tensor> rotate(rotary::RotaryEmbedding& rope, const Tensor& q, const Tensor& k, int64_t pos) {
    if (!record) return rope->forward(q, k, pos);
    Samples& s = q.size(2) > 1 ? prefill : decode;
    const int reps = q.size(2) > 1 ? kPrefillReps : 1;
    const auto start = Clock::now();
    double first = 0.0;
    Tensor q1, k1, q2, k2;
    for (int rep = 0; rep < reps; ++rep) {
      const bool reference_first = turns++ % 2;
      double ours = 0.0, reference = 0.0;
      for (int turn = 0; turn < 2; ++turn) {
        const auto t0 = Clock::now();
        if ((turn == 0) != reference_first) {
          std::tie(q1, k1) = rope->forward(q, k, pos);
          ours = seconds_since(t0);
        } else {
          q2 = reference_apply_rope(q, rope->freqs, pos);
          k2 = reference_apply_rope(k, rope->freqs, pos);
          reference = seconds_since(t0);
        }
      }
      s.ours.push_back(ours);
      s.reference.push_back(reference);
      if (rep == 0) first = ours;
    }
    max_diff = std::max({max_diff, (q1 - q2).abs().max().item<double>(), (k1 - k2).abs().max().item<double>()});
    extra += seconds_since(start) - first;
    return {q1, k1};
  }
};

torch::nn::Linear linear(int64_t in, int64_t out, double gain = 1.0) {
  torch::nn::Linear l(torch::nn::LinearOptions(in, out).bias(false));
  torch::NoGradGuard no_grad;
  l->weight.normal_(0.0, gain / std::sqrt(static_cast<double>(in)));
  return l;
}

struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps) : eps(eps) {
    weight = register_parameter("weight", 1.0 + 0.1 * torch::randn({dim}));
  }
  Tensor forward(const Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
  }
  Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(const Config& c, rotary::RotaryEmbedding rope)
      : c(c),
        // Larger q/k weights give peaked attention, so a position error shows.
        wq(register_module("wq", linear(c.hidden, c.heads * c.head_dim, 1.5))),
        wk(register_module("wk", linear(c.hidden, c.kv_heads * c.head_dim, 1.5))),
        wv(register_module("wv", linear(c.hidden, c.kv_heads * c.head_dim))),
        wo(register_module("wo", linear(c.heads * c.head_dim, c.hidden))),
        rope(std::move(rope)) {}

  // x: [batch, seq, hidden] at positions start_pos .. start_pos + seq - 1.
  // With a cache, k and v are written at those rows and attention reads rows
  // 0 .. start_pos + seq - 1; without one, x must be the whole sequence.
  // rope_shift (a deliberate bug for the control) rotates at start_pos + shift.
  Tensor forward(const Tensor& x, int64_t start_pos, rotary::KVCache* cache, RopeClock* clock, int64_t rope_shift) {
    const int64_t b = x.size(0), s = x.size(1);
    // [batch, seq, heads, dim] viewed as [batch, heads, seq, dim]: no copy.
    auto q = wq(x).view({b, s, c.heads, c.head_dim}).transpose(1, 2);
    auto k = wk(x).view({b, s, c.kv_heads, c.head_dim}).transpose(1, 2);
    auto v = wv(x).view({b, s, c.kv_heads, c.head_dim}).transpose(1, 2);

    Tensor keys, values;
    if (cache) {
      // The cache holds positions 0 .. start_pos - 1; one op rotates q and k
      // in place and appends k and v. The clock times the out-of-place
      // forward on the same q/k, which must give the same bits.
      Tensor q_ref, k_ref;
      if (clock) std::tie(q_ref, k_ref) = clock->rotate(rope, q, k, start_pos + rope_shift);
      std::tie(q, keys, values) = rope->forward_with_cache(q, k, v, *cache, start_pos + rope_shift);
      if (clock) clock->fused_diff = std::max({clock->fused_diff, (q - q_ref).abs().max().item<double>(),
                                               (k - k_ref).abs().max().item<double>()});
    } else {
      std::tie(q, keys) = rope->forward(q, k, start_pos + rope_shift);
      values = v;
    }
    const int64_t group = c.heads / c.kv_heads;  // GQA: query head h reads kv head h / group
    keys = keys.repeat_interleave(group, 1);
    values = values.repeat_interleave(group, 1);

    auto scores = torch::matmul(q, keys.transpose(-2, -1)) / std::sqrt(static_cast<double>(c.head_dim));
    if (s > 1) {  // causal: query at absolute position p sees keys 0 .. p
      auto qpos = torch::arange(start_pos, start_pos + s).unsqueeze(1);
      auto kpos = torch::arange(keys.size(2)).unsqueeze(0);
      scores = scores.masked_fill(kpos > qpos, -std::numeric_limits<float>::infinity());
    }
    auto out = torch::matmul(torch::softmax(scores, -1), values);
    return wo(out.transpose(1, 2).reshape({b, s, c.heads * c.head_dim}));
  }

  Config c;
  torch::nn::Linear wq, wk, wv, wo;
  rotary::RotaryEmbedding rope;  // shared by all layers; registered by the model
};
TORCH_MODULE(Attention);

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const Config& c)
      : gate(register_module("gate", linear(c.hidden, c.ffn))),
        up(register_module("up", linear(c.hidden, c.ffn))),
        down(register_module("down", linear(c.ffn, c.hidden))) {}
  Tensor forward(const Tensor& x) { return down(torch::silu(gate(x)) * up(x)); }  // SwiGLU
  torch::nn::Linear gate, up, down;
};
TORCH_MODULE(MLP);

struct BlockImpl : torch::nn::Module {
  BlockImpl(const Config& c, rotary::RotaryEmbedding rope)
      : attn_norm(register_module("attn_norm", RMSNorm(c.hidden, c.eps))),
        attn(register_module("attn", Attention(c, std::move(rope)))),
        mlp_norm(register_module("mlp_norm", RMSNorm(c.hidden, c.eps))),
        mlp(register_module("mlp", MLP(c))) {}
  Tensor forward(const Tensor& x, int64_t start_pos, rotary::KVCache* cache, RopeClock* clock, int64_t rope_shift) {
    auto h = x + attn->forward(attn_norm(x), start_pos, cache, clock, rope_shift);
    return h + mlp(mlp_norm(h));
  }
  RMSNorm attn_norm;
  Attention attn;
  RMSNorm mlp_norm;
  MLP mlp;
};
TORCH_MODULE(Block);

struct DecoderImpl : torch::nn::Module {
  explicit DecoderImpl(const Config& c)
      : c(c),
        // One table for all layers; one spare row for the control's start_pos + 1.
        rope(register_module(
            "rope", rotary::RotaryEmbedding(
                        rotary::RotaryEmbeddingOptions(c.head_dim).max_seq_len(c.max_len + 1).theta(c.theta)))),
        embed(register_module("embed", torch::nn::Embedding(c.vocab, c.hidden))),
        norm(register_module("norm", RMSNorm(c.hidden, c.eps))),
        lm_head(register_module("lm_head", linear(c.hidden, c.vocab))) {
    for (int64_t i = 0; i < c.layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block(c, rope)));
  }

  std::vector<rotary::KVCache> new_cache(int64_t batch) const {
    std::vector<rotary::KVCache> caches;
    for (int64_t i = 0; i < c.layers; ++i)
      caches.emplace_back(rotary::KVCacheOptions(batch, c.kv_heads, c.max_len, c.head_dim));
    return caches;
  }

  // tokens: [batch, seq] int64 at positions start_pos ..; returns [batch, seq, vocab].
  Tensor forward(const Tensor& tokens, int64_t start_pos, std::vector<rotary::KVCache>* caches = nullptr,
                 RopeClock* clock = nullptr, int64_t rope_shift = 0) {
    auto h = embed(tokens);
    for (size_t i = 0; i < blocks.size(); ++i)
      h = blocks[i]->forward(h, start_pos, caches ? &(*caches)[i] : nullptr, clock, rope_shift);
    return lm_head(norm(h));
  }

  Config c;
  rotary::RotaryEmbedding rope;
  torch::nn::Embedding embed;
  std::vector<Block> blocks;
  RMSNorm norm;
  torch::nn::Linear lm_head;
};
TORCH_MODULE(Decoder);

}  // namespace

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
