// Shared test helpers: per-dtype tolerances, a float64 closeness assertion
// that reports the worst element, allocator poisoning and error matching,
// and what tests split over several files share (a table, fixtures).
#pragma once

#include <rotary/freqs.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/utils.h>

#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace rotary_test {

struct Tolerance {
  double atol;
  double rtol;
};
// float32 within 1e-5 absolute (unit-normal values against the table).
constexpr Tolerance kF32{1e-5, 0.0};
// float64 within 1e-6 absolute.
constexpr Tolerance kF64{1e-6, 0.0};

// tests/tolerances.txt is the one tolerance table; the Python tests read it
// too. CMake passes its path, so the binary finds it from any directory.
#ifndef ROTARY_TOLERANCES_FILE
#error "ROTARY_TOLERANCES_FILE (the path of tests/tolerances.txt) comes from tests/cpp/CMakeLists.txt"
#endif

// Parses "dtype rtol atol" lines ('#' starts a comment); throws on a
// malformed line or a missing dtype, so a broken table fails every test.
inline std::map<at::ScalarType, Tolerance> read_tolerances(const std::string& path) {
  static const std::map<std::string, at::ScalarType> names = {
      {"float32", at::kFloat}, {"float64", at::kDouble}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16}};
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open the tolerance table " + path);
  std::map<at::ScalarType, Tolerance> table;
  std::string raw;
  for (int line = 1; std::getline(in, raw); ++line) {
    std::istringstream fields(raw.substr(0, raw.find('#')));
    std::string name, extra;
    double rtol = 0.0, atol = 0.0;
    if (!(fields >> name)) continue;  // blank or comment
    const auto it = names.find(name);
    if (it == names.end() || !(fields >> rtol >> atol) || (fields >> extra) || table.count(it->second)) {
      throw std::runtime_error(path + ":" + std::to_string(line) + ": expected a new 'dtype rtol atol' line, got '" +
                               raw + "'");
    }
    table[it->second] = Tolerance{atol, rtol};
  }
  for (const auto& [name, type] : names) {
    if (!table.count(type)) throw std::runtime_error(path + ": no tolerance for " + name);
  }
  return table;
}

// Unit-normal data drawn in float32 and rounded once to dtype, so the
// reference sees exactly the values the kernel sees.
inline at::Tensor randn(at::IntArrayRef sizes, at::ScalarType dtype = at::kFloat) {
  return at::randn(sizes, at::kFloat).to(dtype);
}

// Unit-normal float32 data from a seed, shifted off zero (never zeros).
inline at::Tensor seeded_randn(at::IntArrayRef sizes, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, g, at::kFloat) + 0.1;
}

inline at::Tensor longs(const std::vector<int64_t>& v) {
  return at::tensor(v, at::kLong);
}

enum class Layout { kContiguous, kTransposed, kPackedQkv, kMisaligned, kStridedLastDim };

inline const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous: return "contiguous";
    case Layout::kTransposed: return "transposed";
    case Layout::kPackedQkv: return "packed_qkv";
    case Layout::kMisaligned: return "misaligned";
    case Layout::kStridedLastDim: return "strided_last_dim";
  }
  return "?";
}

// q [B, Hq, S, D] and k [B, Hk, S, D] laid out as asked, filled with randn.
inline std::pair<at::Tensor, at::Tensor> make_qk(
    Layout layout, int64_t B, int64_t Hq, int64_t Hk, int64_t S, int64_t D, at::ScalarType dtype) {
  const auto opts = at::TensorOptions().dtype(dtype);
  switch (layout) {
    case Layout::kContiguous:
      return {at::randn({B, Hq, S, D}, opts), at::randn({B, Hk, S, D}, opts)};
    case Layout::kTransposed:
      return {at::randn({B, S, Hq, D}, opts).transpose(1, 2), at::randn({B, S, Hk, D}, opts).transpose(1, 2)};
    case Layout::kPackedQkv: {
      auto qkv = at::randn({B, S, Hq + 2 * Hk, D}, opts).transpose(1, 2);
      return {qkv.narrow(1, 0, Hq), qkv.narrow(1, Hq, Hk)};
    }
    case Layout::kMisaligned: {
      // One element past an aligned base, so no row start is 16-byte aligned.
      auto flat_q = at::randn({B * Hq * S * D + 1}, opts);
      auto flat_k = at::randn({B * Hk * S * D + 1}, opts);
      return {flat_q.narrow(0, 1, B * Hq * S * D).view({B, Hq, S, D}),
              flat_k.narrow(0, 1, B * Hk * S * D).view({B, Hk, S, D})};
    }
    case Layout::kStridedLastDim:
      return {at::randn({B, Hq, S, D, 2}, opts).select(4, 1), at::randn({B, Hk, S, D, 2}, opts).select(4, 0)};
  }
  return {};
}

// t as an optional argument: none when undefined.
inline std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The table's entry for t; other dtypes compare exactly.
inline Tolerance tolerance_for(at::ScalarType t) {
  static const std::map<at::ScalarType, Tolerance> table = read_tolerances(ROTARY_TOLERANCES_FILE);
  const auto it = table.find(t);
  return it == table.end() ? Tolerance{0.0, 0.0} : it->second;
}

// |actual - expected| <= atol + rtol * |expected| elementwise, compared in
// float64, with matching shapes and no NaN/Inf anywhere in actual.
inline ::testing::AssertionResult AllClose(
    const at::Tensor& actual, const at::Tensor& expected, Tolerance tol) {
  if (actual.sizes() != expected.sizes()) {
    std::ostringstream os;
    os << "shape mismatch: actual " << actual.sizes() << " vs expected " << expected.sizes();
    return ::testing::AssertionFailure() << os.str();
  }
  const at::Tensor a = actual.detach().to(at::kCPU).to(at::kDouble).contiguous();
  const at::Tensor e = expected.detach().to(at::kCPU).to(at::kDouble).contiguous();
  if (a.numel() == 0) return ::testing::AssertionSuccess();
  const int64_t non_finite = (~at::isfinite(a)).sum().item<int64_t>();
  if (non_finite > 0) {
    return ::testing::AssertionFailure() << non_finite << " of " << a.numel()
                                         << " output elements are NaN/Inf (unwritten or corrupted output)";
  }
  const at::Tensor err = (a - e).abs();
  const at::Tensor excess = err - (tol.atol + tol.rtol * e.abs());
  const int64_t bad = (excess > 0).sum().item<int64_t>();
  if (bad == 0) return ::testing::AssertionSuccess();
  const int64_t worst = excess.flatten().argmax().item<int64_t>();
  std::ostringstream os;
  os << bad << " of " << a.numel() << " elements out of tolerance (atol " << tol.atol << ", rtol " << tol.rtol
     << "); worst flat index " << worst << ": actual " << a.flatten()[worst].item<double>() << ", expected "
     << e.flatten()[worst].item<double>() << ", |err| " << err.flatten()[worst].item<double>()
     << "; max |err| " << err.max().item<double>();
  return ::testing::AssertionFailure() << os.str();
}

// Fills and frees NaN blocks of the sizes the next call will allocate, so a
// reused heap block shows up as NaN wherever the kernel forgets to write.
// Best effort (the allocator decides); the per-element comparison against
// the reference is what actually proves every element was written.
inline void poison_allocator(const std::vector<int64_t>& byte_sizes) {
  std::vector<at::Tensor> blocks;
  for (int64_t bytes : byte_sizes) {
    blocks.push_back(at::full({(bytes + 7) / 8}, std::numeric_limits<double>::quiet_NaN(), at::kDouble));
  }
  blocks.clear();
}
inline void poison_like(const at::Tensor& t) {
  poison_allocator({static_cast<int64_t>(t.numel() * t.element_size())});
}

// Runs f, which must throw exactly Expected (a c10::Error subclass such as
// c10::ValueError), whose message contains every one of `parts`.
template <typename Expected, typename F>
void ExpectError(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected " << c10::demangle(typeid(Expected).name()) << ", nothing was thrown";
  } catch (const c10::Error& e) {
    if (dynamic_cast<const Expected*>(&e) == nullptr) {
      ADD_FAILURE() << "expected " << c10::demangle(typeid(Expected).name()) << " but got "
                    << c10::demangle(typeid(e).name()) << ": " << e.what_without_backtrace();
      return;
    }
    const std::string msg = e.what_without_backtrace();
    for (const auto& part : parts) EXPECT_THAT(msg, ::testing::HasSubstr(part));
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected " << c10::demangle(typeid(Expected).name()) << " but got std::exception: "
                  << e.what();
  }
}

// Bitwise equality through an integer view of the same width (fp8 bytes
// too), naming the first element that differs.
inline ::testing::AssertionResult SameBits(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.element_size() != b.element_size()) {
    return ::testing::AssertionFailure() << "shapes or element sizes differ: " << a.sizes() << " vs " << b.sizes();
  }
  const auto size = a.element_size();
  const auto int_type = size == 8 ? at::kLong : size == 4 ? at::kInt : size == 2 ? at::kShort : at::kByte;
  const at::Tensor ia = a.contiguous().view(int_type), ib = b.contiguous().view(int_type);
  const at::Tensor diff = ia.ne(ib);
  const int64_t n = diff.sum().item<int64_t>();
  if (n == 0) return ::testing::AssertionSuccess();
  const int64_t at_ = diff.flatten().nonzero()[0][0].item<int64_t>();
  return ::testing::AssertionFailure() << n << " of " << a.numel() << " elements differ; first at flat index "
                                       << at_ << ": " << ia.flatten()[at_].item<int64_t>() << " vs "
                                       << ib.flatten()[at_].item<int64_t>();
}

inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "fp32";
    case at::kDouble: return "fp64";
    case at::kHalf: return "fp16";
    case at::kBFloat16: return "bf16";
    default: return c10::toString(t);
  }
}

// A positions case written in the reference's convention (ref_rope /
// ref_varlen: [] or [batch] offsets added to start + s; [batch, seq] ids, or
// [total_tokens] when packed, added to start) as the op's arguments.
struct OpPositions {
  int64_t start_pos;
  std::optional<at::Tensor> offsets, position_ids;
};
inline OpPositions op_positions(int64_t start, const std::optional<at::Tensor>& pos, bool packed = false) {
  if (!pos) return {start, std::nullopt, std::nullopt};
  const bool ids = packed ? pos->dim() == 1 : pos->dim() == 2;
  if (!ids) return {start, pos, std::nullopt};
  return {0, std::nullopt, *pos + start};
}

// The device axis: a TEST_P of a suite derived from OnDevice runs on the CPU
// and, where a GPU is visible, on CUDA, so both backends pass one test.
class OnDevice : public ::testing::TestWithParam<c10::DeviceType> {
 protected:
  void SetUp() override {
    if (GetParam() == c10::kCUDA && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    at::manual_seed(20);
  }
  at::TensorOptions on(at::ScalarType dtype = at::kFloat) const {
    return at::TensorOptions().device(GetParam()).dtype(dtype);
  }
};

inline std::string device_name(const ::testing::TestParamInfo<c10::DeviceType>& info) {
  return info.param == c10::kCUDA ? "cuda" : "cpu";
}

#define ROTARY_ON_DEVICES(Suite) \
  INSTANTIATE_TEST_SUITE_P(Devices, Suite, ::testing::Values(c10::kCPU, c10::kCUDA), rotary_test::device_name)

// A copy with t's sizes and strides (a view's layout kept); undefined stays so.
inline at::Tensor same_strides(const at::Tensor& t) {
  return t.defined() ? at::empty_strided(t.sizes(), t.strides(), t.options()).copy_(t) : t;
}

// A KV-cache call's inputs with q, k, v, the caches and the slots copied
// with the same strides (a misaligned view stays misaligned); the rest
// (tables, scales, positions) shared.
template <typename Inputs>
Inputs copy_cache_inputs(const Inputs& in) {
  Inputs out = in;
  for (at::Tensor* t : {&out.q, &out.k, &out.v, &out.kc, &out.vc, &out.slots}) *t = same_strides(*t);
  return out;
}

// k_scale and v_scale of an fp8 cache: per tensor, or one per head.
inline std::pair<at::Tensor, at::Tensor> fp8_scales(bool per_head, int64_t heads) {
  if (!per_head) return {at::tensor(0.5f), at::tensor(0.25f)};
  return {at::rand({heads}) + 0.25, at::rand({heads}) + 0.25};
}

// fn(c) for a Case{} per dtype, cache dtype (its own, then fp8) and cache
// layout, named after them.
template <typename Case, typename Fn>
void for_each_cache_case(Fn fn) {
  for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (const bool fp8 : {false, true}) {
      for (const std::string layout : {"BHSD", "BSHD", "NHD", "HND"}) {
        Case c;
        c.name = dtype_name(dtype) + (fp8 ? " fp8 " : " ") + layout;
        c.dtype = dtype;
        c.fp8 = fp8;
        c.kv_layout = layout;
        fn(c);
      }
    }
  }
}

// Two cases of a named edit of Case{}: rotate-half pairs, then interleaved.
template <typename Case, typename Edit>
void add_both_pairings(std::vector<Case>& cases, const std::string& name, Edit edit) {
  for (const bool interleaved : {false, true}) {
    Case c;
    c.name = name + (interleaved ? " interleaved" : " half");
    c.interleaved = interleaved;
    edit(c);
    cases.push_back(c);
  }
}

// The table the argument-error tests pass (test_errors_tensors.cpp,
// test_errors_positions.cpp, test_bad_input_matrix.cpp).
inline const at::Tensor& freqs8() {
  static const at::Tensor f = rotary::rope_freqs(8, 16);  // [16, 4], head_dim 8
  return f;
}

// Fixtures of suites whose tests live in several files (gtest wants one
// fixture class per suite): each seeds the generator before every test.
// Seeded: the functional API's numerical tests (test_ops_*.cpp).
class Seeded : public ::testing::Test {
 protected:
  void SetUp() override { at::manual_seed(20240611); }
};

// RotaryModule: the module's tests (test_module_*.cpp).
class RotaryModule : public ::testing::Test {
 protected:
  void SetUp() override { torch::manual_seed(4321); }
};

}  // namespace rotary_test
