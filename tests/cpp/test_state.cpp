// Module state: one module called from many threads, torch::save /
// torch::load round trips, and loading tables the options would not build.
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/module.h>
#include <rotary/tables.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <atomic>
#include <cmath>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using rotary::RotaryEmbedding;
using rotary::RotaryEmbeddingOptions;
using rotary_test::ExpectError;

rotary::RopeScaling yarn64() {
  return rotary::RopeScaling("yarn").factor(4.0).original_max_position_embeddings(64);
}
rotary::RopeScaling dynamic64() {
  return rotary::RopeScaling("dynamic").factor(2.0).max_position_embeddings(64);
}
rotary::RopeScaling longrope64() {
  return rotary::RopeScaling("longrope")
      .short_factor({1.0, 1.5, 2.0, 3.0})
      .long_factor({2.0, 3.0, 4.0, 6.0})
      .original_max_position_embeddings(64)
      .factor(4.0);
}

// Runs body(i) on n threads started together.
template <typename F>
void run_threads(int n, F body) {
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      ready.fetch_add(1);
      while (ready.load() < n) std::this_thread::yield();
      body(i);
    });
  }
  for (auto& t : threads) t.join();
}

TEST(ModuleState, OneModuleManyThreads) {
  for (const auto& scaling : {rotary::RopeScaling(), yarn64()}) {
    RotaryEmbedding rope(RotaryEmbeddingOptions(32).max_seq_len(64).scaling(scaling));
    const int n = 8, rounds = 20;
    std::vector<at::Tensor> qs, ks;
    std::vector<std::tuple<at::Tensor, at::Tensor>> want;
    for (int i = 0; i < n; ++i) {
      qs.push_back(at::randn({2, 4, 16, 32}));
      ks.push_back(at::randn({2, 2, 16, 32}));
      want.push_back(rope->forward(qs[i], ks[i], (7 * i) % 90));  // some past the 64 cached rows
    }
    std::atomic<int> mismatches{0};
    run_threads(n, [&](int i) {
      for (int r = 0; r < rounds; ++r) {
        const auto [q2, k2] = rope->forward(qs[i], ks[i], (7 * i) % 90);
        if (!at::equal(q2, std::get<0>(want[i])) || !at::equal(k2, std::get<1>(want[i]))) ++mismatches;
      }
    });
    EXPECT_EQ(mismatches.load(), 0) << scaling.type();
  }
}

// dynamic rebuilds its table per call: reach 200 grows it, reach 16 returns
// to the original frequencies. Every call must see the table of its own
// reach even while other threads rebuild it.
TEST(ModuleState, HostDrivenRuleManyThreads) {
  const auto options = RotaryEmbeddingOptions(16).max_seq_len(64).interleaved(false).scaling(dynamic64());
  RotaryEmbedding rope(options);
  const auto x = at::randn({1, 2, 16, 16});
  const auto short_want = RotaryEmbedding(options)->forward(x, 0);
  const auto long_want = RotaryEmbedding(options)->forward(x, 184);
  std::atomic<int> mismatches{0};
  run_threads(8, [&](int i) {
    for (int r = 0; r < 12; ++r) {
      const bool grow = (i + r) % 2;
      const auto out = rope->forward(x, grow ? 184 : 0);
      if (!at::equal(out, grow ? long_want : short_want)) ++mismatches;
    }
  });
  EXPECT_EQ(mismatches.load(), 0);
}

at::Tensor forward_far(RotaryEmbedding& m, const at::Tensor& x) {
  return m->forward(x, m->options.angle_dtype() == torch::kFloat32 ? 40 : 300);
}

TEST(ModuleState, SaveLoadRoundTrip) {
  const std::vector<RotaryEmbeddingOptions> specs = {
      RotaryEmbeddingOptions(8).max_seq_len(64).theta(500.0),
      RotaryEmbeddingOptions(8).max_seq_len(64).theta(500.0).scaling(yarn64()),
      RotaryEmbeddingOptions(8).max_seq_len(64).theta(500.0).angle_dtype(torch::kFloat32),
      RotaryEmbeddingOptions(8).max_seq_len(64).theta(500.0).scaling(longrope64()),
      RotaryEmbeddingOptions(8).max_seq_len(64).theta(500.0).scaling(dynamic64()),
  };
  const auto x = at::randn({1, 2, 8, 8});
  for (const auto& o : specs) {
    RotaryEmbedding a(o);
    forward_far(a, x);  // host-driven rules leave their initial state (grown / long factors)
    std::stringstream stream;
    torch::save(a, stream);
    RotaryEmbedding b(o);
    torch::load(b, stream);
    EXPECT_TRUE(at::equal(b->freqs, a->freqs)) << o.scaling().type();
    EXPECT_TRUE(at::equal(b->inv_freq, a->inv_freq)) << o.scaling().type();
    EXPECT_TRUE(b->named_buffers()["freqs"].is_same(b->freqs));
    EXPECT_TRUE(at::equal(b->forward(x, 5), a->forward(x, 5)));
    EXPECT_TRUE(at::equal(forward_far(b, x), forward_far(a, x)));
  }
}

// (saved from, loaded into, substrings of the c10::ValueError)
struct Mismatch {
  const char* name;
  RotaryEmbeddingOptions from;
  RotaryEmbeddingOptions into;
  std::vector<std::string> parts;
};

TEST(ModuleState, LoadingOtherTablesThrows) {
  const auto base = RotaryEmbeddingOptions(8).max_seq_len(32);
  const auto longer = RotaryEmbeddingOptions(8).max_seq_len(1024);
  const std::vector<Mismatch> cases = {
      {"theta", RotaryEmbeddingOptions(base).theta(5e5), base, {"theta=10000", "'inv_freq'[1] =", "these options give"}},
      {"rule", RotaryEmbeddingOptions(base).scaling(yarn64()), base, {"rope_type=default", "'inv_freq'["}},
      {"max_seq_len", RotaryEmbeddingOptions(base).max_seq_len(48), base, {"'freqs' has 48 rows", "max_seq_len is 32"}},
      {"dim", RotaryEmbeddingOptions(16).max_seq_len(32), base, {"'freqs' must be complex64 [rows, dim / 2] = [*, 4]", "[32, 8]"}},
      {"angle_dtype", RotaryEmbeddingOptions(longer).angle_dtype(torch::kFloat32), longer,
       {"angle_dtype=float64", "'freqs' row ", "differs by"}},
      {"angle_dtype back", longer, RotaryEmbeddingOptions(longer).angle_dtype(torch::kFloat32),
       {"angle_dtype=float32", "'freqs' row "}},
  };
  for (const auto& c : cases) {
    RotaryEmbedding a(c.from);
    std::stringstream stream;
    torch::save(a, stream);
    RotaryEmbedding b(c.into);
    const auto freqs = b->freqs.clone();
    const auto inv = b->inv_freq.clone();
    auto parts = c.parts;
    parts.push_back("RotaryEmbedding.load: ");
    ExpectError<c10::ValueError>([&] { torch::load(b, stream); }, parts);
    EXPECT_TRUE(at::equal(b->freqs, freqs)) << c.name << ": the buffers changed";
    EXPECT_TRUE(at::equal(b->inv_freq, inv)) << c.name;
  }
}

TEST(ModuleState, LoadTablesRejectsCorruption) {
  RotaryEmbedding m(RotaryEmbeddingOptions(8).max_seq_len(32));
  auto f = m->freqs.clone();
  f[5][1] = f[5][1] * 1.001;
  ExpectError<c10::ValueError>([&] { m->load_tables(f, m->inv_freq.clone()); }, {"'freqs' row 5, pair 1 differs"});
  auto g = m->freqs.clone();
  g[3][0] = c10::complex<float>(NAN, NAN);
  ExpectError<c10::ValueError>([&] { m->load_tables(g, std::nullopt); }, {"'freqs' row 3, pair 0"});
  ExpectError<c10::ValueError>(
      [&] { m->load_tables(at::view_as_real(m->freqs), std::nullopt); }, {"'freqs' must be complex64", "Float"});
  ExpectError<c10::ValueError>(
      [&] { m->load_tables(std::nullopt, m->inv_freq.to(at::kFloat)); }, {"'inv_freq' must be float64"});
  ExpectError<c10::ValueError>(
      [&] { m->load_tables(std::nullopt, m->inv_freq * (1 + 1e-9)); }, {"'inv_freq'[0] = 1.000000001"});
  // What the options build loads, from either buffer alone too.
  m->load_tables(m->freqs.clone(), m->inv_freq.clone());
  m->load_tables(m->freqs.clone(), std::nullopt);
  m->load_tables(std::nullopt, m->inv_freq.clone());
}

TEST(ModuleState, LoadRestoresGrownDynamicState) {
  const auto o = RotaryEmbeddingOptions(8).max_seq_len(64).scaling(dynamic64());
  RotaryEmbedding a(o);
  const auto x = at::randn({1, 1, 4, 8});
  a->forward(x, 196);  // reach 200 > 64: grown (float64 angles: row 0 alone, the rest on the fly)
  ASSERT_EQ(a->freqs.size(0), 1);
  std::stringstream stream;
  torch::save(a, stream);
  RotaryEmbedding b(o);
  torch::load(b, stream);
  EXPECT_EQ(b->freqs.size(0), 1);
  EXPECT_TRUE(at::equal(b->inv_freq, a->inv_freq));
  EXPECT_TRUE(at::equal(b->forward(x, 10), RotaryEmbedding(o)->forward(x, 10)));  // shrinks back
  EXPECT_EQ(b->freqs.size(0), 64);
}

TEST(ModuleState, AngleDtypeValidated) {
  ExpectError<c10::ValueError>(
      [] { RotaryEmbedding(RotaryEmbeddingOptions(8).angle_dtype(torch::kHalf)); },
      {"RotaryEmbedding: angle_dtype must be float64", "got Half"});
  ExpectError<c10::ValueError>(
      [] { rotary::rope_freqs(8, 4, 1e4, rotary::RopeScaling(), 0, at::kBFloat16); },
      {"rope_freqs: angle_dtype must be float64", "got BFloat16"});
  ExpectError<c10::ValueError>(
      [] { rotary::angle_dtype_from_string("float16", "rope_freqs"); }, {"angle_dtype must be 'float64'", "'float16'"});
  EXPECT_EQ(rotary::angle_dtype_from_string("torch.float32", "x"), at::kFloat);
  EXPECT_EQ(rotary::angle_dtype_name(at::kDouble), "float64");
}


// ---------------------------------------------------------------------------
// RopeTables: the state machine both modules share.
// ---------------------------------------------------------------------------
TEST(RopeTables, StatesOfTheHostDrivenRules) {
  rotary::RopeTables dyn(RotaryEmbeddingOptions(8).max_seq_len(48).scaling(
      rotary::RopeScaling("dynamic").factor(2.0).max_position_embeddings(32)));
  EXPECT_TRUE(dyn.host_driven());
  EXPECT_EQ(dyn.state(), 0);
  EXPECT_EQ(dyn.state_for_reach(24), 0);  // under max_position_embeddings: unchanged
  EXPECT_EQ(dyn.state_for_reach(40), 40);  // grows
  rotary::RopeTables lr(RotaryEmbeddingOptions(8).scaling(longrope64()));
  EXPECT_TRUE(lr.host_driven());
  EXPECT_EQ(lr.state_for_reach(64), 0);
  EXPECT_EQ(lr.state_for_reach(65), 65);  // long factors
  rotary::RopeTables plain(RotaryEmbeddingOptions(8).scaling(yarn64()));
  EXPECT_FALSE(plain.host_driven());
  EXPECT_EQ(plain.state_for_reach(1 << 20), 0);
  // The unset max_position_embeddings of dynamic is max_seq_len.
  rotary::RopeTables dflt(RotaryEmbeddingOptions(8).max_seq_len(48).scaling(rotary::RopeScaling("dynamic").factor(2.0)));
  EXPECT_EQ(*dflt.options().scaling().max_position_embeddings(), 48);
  EXPECT_EQ(dflt.state_for_reach(48), 0);
  EXPECT_EQ(dflt.state_for_reach(49), 49);
}

TEST(RopeTables, RunRecordsTheStateOnlyWhenTheOpReturns) {
  using Held = rotary::RopeTables::Held;
  rotary::RopeTables t(RotaryEmbeddingOptions(8).max_seq_len(64).scaling(dynamic64()));
  const rotary::RopeTableSet initial = t.build(0);
  Held held{initial.freqs, initial.inv_freq};  // the module's buffers
  EXPECT_THROW(
      t.run(200, at::kCPU, [&] { return held; }, [](const rotary::RopeTableSet* fresh) -> int {
        EXPECT_NE(fresh, nullptr);
        throw std::runtime_error("the op refused the call");
      }),
      std::runtime_error);
  EXPECT_EQ(t.state(), 0);
  t.run(200, at::kCPU, [&] { return held; }, [&](const rotary::RopeTableSet* fresh) {
    held = {fresh->freqs, fresh->inv_freq};  // installed
    return 0;
  });
  EXPECT_EQ(held.first.size(0), 1);  // a grown float64-angle table: row 0 alone
  EXPECT_EQ(t.state(), 200);
  t.run(100, at::kCPU, [&] { return held; }, [](const rotary::RopeTableSet* fresh) {
    EXPECT_EQ(fresh, nullptr);  // reach 100 <= 200: the grown tables stay
    return 0;
  });
  const rotary::RopeTables copy = t;  // a copy keeps the state, with its own lock
  EXPECT_EQ(copy.state(), 200);
  // The module holds its initial tables again (functional_call puts them
  // back): their state comes back with them, and reach 100 grows anew.
  const Held first{initial.freqs, initial.inv_freq};
  EXPECT_EQ(t.state_of([&] { return first; }), 0);
  EXPECT_EQ(t.attention_scaling(), 1.0);
  int64_t grown = 0;
  t.run(100, at::kCPU, [&] { return first; }, [&](const rotary::RopeTableSet* fresh) {
    grown = fresh ? fresh->state : -1;
    return 0;
  });
  EXPECT_EQ(grown, 100);
  EXPECT_EQ(t.state_of([&] { return held; }), 200);  // the 200-row tables, held again
  // Tables it never met (a copy, a move, another module's): their inv_freq says the state.
  EXPECT_EQ(t.state_of([&] { return Held{held.first.clone(), held.second.clone()}; }), 200);
  const rotary::RopeTableSet other = t.build(77);
  EXPECT_EQ(t.state_of([&] { return Held{other.freqs.clone(), other.inv_freq.clone()}; }), 77);
  // ... and tables no state of these options builds are refused by name.
  const Held wrong{initial.freqs.clone(), initial.inv_freq * 1.5};
  rotary_test::ExpectError<c10::ValueError>([&] { t.state_of([&] { return wrong; }); },
                                            {"RotaryEmbedding: the tables it holds", "do not match this module"});
}

// A call that raises leaves the module as it was: the refused call (odd
// head_dim) must not grow the dynamic table, nor a float32-angle call past
// the rows a dynamic table grows to record the new length.
TEST(RopeTables, RefusedCallLeavesTheModuleAsItWas) {
  const auto o = RotaryEmbeddingOptions(8).max_seq_len(64).scaling(dynamic64());
  RotaryEmbedding rope(o);
  const auto freqs = rope->freqs.clone();
  const auto inv = rope->inv_freq.clone();
  auto unchanged = [&](const char* what) {
    EXPECT_EQ(rope->tables().state(), 0) << what;
    EXPECT_TRUE(at::equal(rope->freqs, freqs)) << what;
    EXPECT_TRUE(at::equal(rope->inv_freq, inv)) << what;
  };
  const auto odd = at::randn({1, 1, 4, 7});
  ExpectError<c10::ValueError>([&] { rope->forward(odd, 996); }, {"head_dim"});
  unchanged("odd head_dim");
  ExpectError<c10::Error>([&] { rope->forward(at::randn({1, 2, 4, 8}), at::randn({1, 2, 5, 8}), 996); }, {});
  unchanged("q/k seq mismatch");
  const auto x = at::randn({1, 1, 4, 8});
  // ... and later calls are right: the same as a fresh module's.
  EXPECT_TRUE(at::equal(rope->forward(x, 300), RotaryEmbedding(o)->forward(x, 300)));
  EXPECT_TRUE(at::equal(rope->forward(x, 3), RotaryEmbedding(o)->forward(x, 3)));

  RotaryEmbedding f32(RotaryEmbeddingOptions(o).angle_dtype(torch::kFloat32));
  const auto f32_freqs = f32->freqs.clone();
  const int64_t past = rotary::RopeTables::kMaxGrownRows;
  ExpectError<c10::IndexError>(
      [&] { f32->forward(x, past); },
      {"= " + std::to_string(past + 4) + " exceeds the rows a dynamic table grows to, " + std::to_string(past),
       "or angle_dtype=float64"});
  EXPECT_EQ(f32->tables().state(), 0);
  EXPECT_TRUE(at::equal(f32->freqs, f32_freqs));
}

// A dynamic call far past the table (2^40 rows would not fit in any memory)
// is served from row 0 alone: every other position is computed on the fly,
// from the grown base. A float32-angle table (no on-the-fly path) grows, up
// to kMaxGrownRows rows.
TEST(RopeTables, FarDynamicReachKeepsTheTableBounded) {
  RotaryEmbedding f32(RotaryEmbeddingOptions(8).max_seq_len(64).scaling(dynamic64()).angle_dtype(torch::kFloat32));
  f32->forward(at::randn({1, 1, 4, 8}), 196);
  EXPECT_EQ(f32->freqs.size(0), 200);

  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(64).scaling(dynamic64()));
  const auto x = at::randn({1, 2, 4, 8}, at::kDouble);
  const int64_t start = int64_t{1} << 40;
  const auto got = rope->forward(x, start);
  EXPECT_EQ(rope->freqs.size(0), 1);
  EXPECT_EQ(rope->tables().state(), start + 4);
  // base = theta * (factor * L / m - (factor - 1))^(d / (d - 2)), L the reach. The angles near 3e7 rad
  // magnify the few ulps between this pow and the rule's own (1e-7); a reach off by one moves them 1e-5.
  const double base = 10000.0 * std::pow(2.0 * static_cast<double>(start + 4) / 64.0 - 1.0, 8.0 / 6.0);
  EXPECT_TRUE(rotary_test::AllClose(got, rotary_test::ref_rope(x, start, true, std::nullopt, false, base), {1e-6, 1e-6}));
}

TEST(RopeTables, LoadingAMetaTensorIsAValueError) {
  RotaryEmbedding m(RotaryEmbeddingOptions(8).max_seq_len(32));
  ExpectError<c10::ValueError>(
      [&] { m->load_tables(m->freqs.to(at::kMeta), std::nullopt); }, {"'freqs' is a meta tensor"});
  ExpectError<c10::ValueError>(
      [&] { m->load_tables(std::nullopt, m->inv_freq.to(at::kMeta)); }, {"'inv_freq' is a meta tensor"});
}

// A float64-angle table is refused by a float32-angle module (and back)
// even where the two differ by less than the entry tolerance.
TEST(RopeTables, LoadingTheOtherAngleDtypeIsAnError) {
  const auto f64 = RotaryEmbeddingOptions(8).max_seq_len(32);  // they differ by less than 2^-22
  const auto f32 = RotaryEmbeddingOptions(f64).angle_dtype(torch::kFloat32);
  RotaryEmbedding a(f64), b(f32);
  ASSERT_FALSE(at::equal(a->freqs, b->freqs));
  ExpectError<c10::ValueError>([&] { b->load_tables(a->freqs, a->inv_freq); }, {"table of angle_dtype=float64"});
  ExpectError<c10::ValueError>([&] { a->load_tables(b->freqs, std::nullopt); }, {"table of angle_dtype=float32"});
  b->load_tables(b->freqs.clone(), b->inv_freq.clone());
}

}  // namespace
