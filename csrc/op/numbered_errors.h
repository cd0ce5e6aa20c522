// A check that fails on symbolic sizes prints them as symbols ("got s0
// (shape [1, s27, s53, s0])"). NumberedErrors<fn> reruns the failed kernel
// on meta tensors of the sizes' hints, the values the trace was made for, so
// the error the user sees names numbers as the eager op's does: the Meta
// kernels and the cos/sin composite register through it. Only a failing
// call pays; its guards cost nothing, the trace ends there. Sizes without a
// hint (unbacked), or a rerun that passes (a check of devices or of storage
// the fresh tensors do not share), keep the original error.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <tuple>
#include <vector>

namespace rotary {
namespace detail {
namespace numbered {

// Whether a call's arguments hold symbols, and whether all have hints.
struct Scan {
  bool symbolic = false, hinted = true;
  void see(const c10::SymInt& s) {
    if (!s.maybe_as_int()) symbolic = true, hinted = hinted && s.has_hint();
  }
  void see(c10::SymIntArrayRef a) {
    for (const auto& s : a) see(s);
  }
  void see(const at::Tensor& t) {
    if (dense(t)) see(t.sym_sizes()), see(t.sym_strides());
  }
  // Sparse, mkldnn and nested tensors have no strides to read (refused by name).
  static bool dense(const at::Tensor& t) {
    return t.defined() && t.layout() == at::kStrided && !t.is_nested();  // mkldnn: its own layout
  }
  void see(const std::optional<at::Tensor>& t) {
    if (t) see(*t);
  }
  template <typename T>
  void see(const T&) {}
};

inline int64_t hint(const c10::SymInt& s) {
  const auto known = s.maybe_as_int();
  return known ? *known : s.guard_int(__FILE__, __LINE__);
}
inline std::vector<int64_t> hints(c10::SymIntArrayRef a) {
  std::vector<int64_t> out;
  for (const auto& s : a) out.push_back(hint(s));
  return out;
}

// An argument at its hints: tensors on meta, whatever device they show (a
// CUDA fake tensor must not allocate).
inline at::Tensor at_hints(const at::Tensor& t) {
  if (!Scan::dense(t)) return t;
  return at::empty_strided(hints(t.sym_sizes()), hints(t.sym_strides()), t.options().device(at::kMeta));
}
inline std::optional<at::Tensor> at_hints(const std::optional<at::Tensor>& t) {
  return t ? std::optional<at::Tensor>(at_hints(*t)) : std::nullopt;
}
inline c10::SymInt at_hints(const c10::SymInt& s) {
  return c10::SymInt(hint(s));
}
template <typename T>
T at_hints(const T& v) {
  return v;
}

}  // namespace numbered

template <auto fn>
struct NumberedErrors;
template <typename R, typename... A, R (*fn)(A...)>
struct NumberedErrors<fn> {
  static R call(A... a) {
    try {
      return fn(a...);
    } catch (const c10::Error&) {
      numbered::Scan scan;
      (scan.see(a), ...);
      if (!scan.symbolic || !scan.hinted) throw;
      auto concrete = std::make_tuple(numbered::at_hints(a)...);
      std::apply(fn, concrete);  // throws the same check's error, with numbers
      throw;
    }
  }
};

}  // namespace detail
}  // namespace rotary

// A registration's kernel through NumberedErrors (ROTARY_IMPL_ALL's wrap).
#define ROTARY_NUMBERED_ERRORS(fn) &::rotary::detail::NumberedErrors<fn>::call
