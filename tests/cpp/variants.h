// Shared by the RoPE variant tests (test_layouts.cpp, test_varlen.cpp,
// test_partial_rotary.cpp, test_inv_freq.cpp, test_inplace.cpp,
// test_variant_gradients.cpp, test_variant_errors.cpp): inputs, layouts and
// the references built on the float64 reference of reference.h:
//   layouts    "BSHD" / "SBHD" are views of the reference's [B, H, S, D];
//   partial    the reference on x.narrow(-1, 0, r) (a head of size r) plus
//              the tail copied unchanged;
//   varlen     the reference run on each sequence of the packed batch alone.
// Also the Variants fixture: its TEST_Ps are spread over several files and
// instantiated once, in test_layouts.cpp.
#pragma once

#include "helpers.h"
#include "reference.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace rotary_test {

using OptTensor = std::optional<at::Tensor>;

inline at::Tensor cu_from_lens(const std::vector<int64_t>& lens, at::ScalarType dtype = at::kLong) {
  std::vector<int64_t> cu{0};
  for (int64_t n : lens) cu.push_back(cu.back() + n);
  return at::tensor(cu, at::kLong).to(dtype);
}

inline std::vector<int64_t> shape_in(const std::string& layout, int64_t B, int64_t H, int64_t S, int64_t D) {
  if (layout == "BSHD") return {B, S, H, D};
  if (layout == "SBHD") return {S, B, H, D};
  return {B, H, S, D};
}

inline at::Tensor to_bhsd(const at::Tensor& x, const std::string& layout) {
  if (layout == "BSHD") return x.transpose(1, 2);
  if (layout == "SBHD") return x.permute({1, 2, 0, 3});
  return x;
}

inline at::Tensor from_bhsd(const at::Tensor& x, const std::string& layout) {
  if (layout == "BSHD") return x.transpose(1, 2);
  if (layout == "SBHD") return x.permute({2, 0, 1, 3});
  return x;
}

// Reference of a 4-D input in `layout`: dims [0, r) rotated as a head of
// size r, dims [r, D) copied.
inline at::Tensor ref_partial(
    const at::Tensor& x, int64_t r, int64_t start = 0, bool interleaved = true, const OptTensor& positions = {},
    bool inverse = false, const std::string& layout = "BHSD") {
  const at::Tensor xb = to_bhsd(x, layout);
  const int64_t D = xb.size(3);
  const at::Tensor rot = ref_rope(xb.narrow(3, 0, r), start, interleaved, positions, inverse);
  const at::Tensor tail = xb.narrow(3, r, D - r).to(at::kCPU).to(at::kDouble);
  return from_bhsd(at::cat({rot, tail}, 3), layout);
}

// Reference of a packed [T, H, D] batch: each sequence on its own.
// positions: none, a 0-d offset or [T] absolute ids.
inline at::Tensor ref_varlen(
    const at::Tensor& x, const at::Tensor& cu, int64_t r, int64_t start = 0, bool interleaved = true,
    const OptTensor& positions = {}, bool inverse = false) {
  const at::Tensor bounds = cu.to(at::kLong).contiguous();
  std::vector<at::Tensor> parts{at::empty({0, x.size(1), x.size(2)}, at::kDouble)};
  for (int64_t n = 0; n + 1 < bounds.numel(); ++n) {
    const int64_t a = bounds[n].item<int64_t>(), b = bounds[n + 1].item<int64_t>();
    const at::Tensor seg = x.slice(0, a, b).permute({1, 0, 2}).unsqueeze(0);  // [1, H, len, D]
    int64_t st = start;
    OptTensor pos;
    if (positions && positions->dim() == 0) {
      st += positions->item<int64_t>();
    } else if (positions) {
      pos = positions->slice(0, a, b).unsqueeze(0);  // [1, len] ids
    }
    parts.push_back(ref_partial(seg, r, st, interleaved, pos, inverse)[0].permute({1, 0, 2}));
  }
  return at::cat(parts, 0);
}

inline at::Tensor inv_freq_f64(int64_t r) {
  std::vector<double> v;
  for (int64_t j = 0; j < r / 2; ++j) v.push_back(rotary_test::ref_inv_freq(j, r));
  return at::tensor(v, at::kDouble);
}

using DtypeCase = std::tuple<at::ScalarType, bool>;

inline std::string case_name(const ::testing::TestParamInfo<DtypeCase>& info) {
  return dtype_name(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_interleaved" : "_half");
}

class Variants : public ::testing::TestWithParam<DtypeCase> {
 protected:
  void SetUp() override { at::manual_seed(4242); }
};

}  // namespace rotary_test
