// Part 2 of the demo: a tiny Llama-style decoder (GQA, RMSNorm, SwiGLU,
// random weights) whose layers share one rotary::RotaryEmbedding and keep a
// rotary::KVCache each.
#pragma once

#include "demo_common.h"

#include <rotary/rotary.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

namespace demo {

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

inline torch::nn::Linear linear(int64_t in, int64_t out, double gain = 1.0) {
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

}  // namespace demo
