// Two strided views overlap when  sum_d c_d * stride_d == target  has an
// integer solution with every c_d in a range given by the sizes: a bounded
// knapsack. A depth-first search over the dims, largest stride first, keeps
// only the c_d that the remaining dims can still complete. For the layouts
// torch makes (slices, transposes, packed qkv) that leaves one or two
// candidates per dim, so the search visits a few dozen nodes; irregular
// strides may need more, and past kBudget nodes the answer is Unknown.
#include "overlap.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace rotary {
namespace detail {
namespace {

using wide = __int128;  // sizes * strides in bytes can leave int64 on meta-like shapes

constexpr int64_t kBudget = int64_t{1} << 20;

wide floor_div(wide a, wide b) {  // b > 0
  wide q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}
wide ceil_div(wide a, wide b) {
  return -floor_div(-a, b);
}

struct Term {
  wide stride;  // > 0, bytes
  wide lo, hi;  // c in [lo, hi]
};

class Search {
 public:
  // nonzero: only solutions with some c != 0 count (the ranges must then be
  // symmetric, so the first nonzero c may be taken positive).
  Search(std::vector<Term> terms, bool nonzero) : terms_(std::move(terms)), nonzero_(nonzero) {
    std::sort(terms_.begin(), terms_.end(), [](const Term& a, const Term& b) { return a.stride > b.stride; });
    min_rest_.assign(terms_.size() + 1, 0);
    max_rest_.assign(terms_.size() + 1, 0);
    for (size_t i = terms_.size(); i-- > 0;) {
      min_rest_[i] = min_rest_[i + 1] + terms_[i].lo * terms_[i].stride;
      max_rest_[i] = max_rest_[i + 1] + terms_[i].hi * terms_[i].stride;
    }
  }

  Overlap solve(wide target) {
    return visit(0, target, true);
  }

 private:
  Overlap visit(size_t i, wide target, bool all_zero) {
    if (i == terms_.size()) return target == 0 && !(nonzero_ && all_zero) ? Overlap::Yes : Overlap::No;
    const Term& t = terms_[i];
    wide lo = std::max(t.lo, ceil_div(target - max_rest_[i + 1], t.stride));
    const wide hi = std::min(t.hi, floor_div(target - min_rest_[i + 1], t.stride));
    if (nonzero_ && all_zero) lo = std::max<wide>(lo, 0);
    bool unknown = false;
    for (wide c = lo; c <= hi; ++c) {
      if (++nodes_ > kBudget) return Overlap::Unknown;
      const Overlap r = visit(i + 1, target - c * t.stride, all_zero && c == 0);
      if (r == Overlap::Yes) return r;
      unknown = unknown || r == Overlap::Unknown;
    }
    return unknown ? Overlap::Unknown : Overlap::No;
  }

  std::vector<Term> terms_;
  bool nonzero_;
  std::vector<wide> min_rest_, max_rest_;
  int64_t nodes_ = 0;
};

wide address(const at::Tensor& t) {
  return static_cast<wide>(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
}

// Adds x's dims as terms c in [0, size - 1] (sign +1) or [-(size - 1), 0]
// (sign -1) and returns the byte address of x's lowest element.
wide add_view_terms(const at::Tensor& x, int sign, std::vector<Term>& terms) {
  wide base = address(x);
  const wide item = static_cast<wide>(x.element_size());
  for (int64_t d = 0; d < x.dim(); ++d) {
    const wide n = x.size(d);
    wide s = static_cast<wide>(x.stride(d)) * item;
    if (n == 1 || s == 0) continue;
    if (s < 0) {  // walk the dim backwards from its lowest address
      base += (n - 1) * s;
      s = -s;
    }
    terms.push_back(sign > 0 ? Term{s, 0, n - 1} : Term{s, -(n - 1), 0});
  }
  return base;
}

}  // namespace

Overlap self_overlap(const at::Tensor& x) {
  if (x.numel() <= 1) return Overlap::No;
  // Two indices i != j collide when sum_d (i_d - j_d) * stride_d == 0.
  std::vector<Term> terms;
  for (int64_t d = 0; d < x.dim(); ++d) {
    const wide n = x.size(d);
    if (n == 1) continue;
    const wide s = static_cast<wide>(x.stride(d) < 0 ? -x.stride(d) : x.stride(d));
    if (s == 0) return Overlap::Yes;  // expanded
    for (const Term& t : terms) {
      if (t.stride == s) return Overlap::Yes;  // two dims step the same distance
    }
    terms.push_back(Term{s, -(n - 1), n - 1});
  }
  return Search(std::move(terms), /*nonzero=*/true).solve(0);
}

Overlap mutual_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return Overlap::No;
  // Elements at byte addresses pa (wa bytes wide) and pb (wb bytes) share a
  // byte when pa - pb = delta with -(wa - 1) <= delta <= wb - 1, i.e.
  //   sum i_d sa_d - sum j_d sb_d - delta == base_b - base_a.
  std::vector<Term> terms;
  const wide base_a = add_view_terms(a, +1, terms);
  const wide base_b = add_view_terms(b, -1, terms);
  terms.push_back(Term{1, -(static_cast<wide>(b.element_size()) - 1), static_cast<wide>(a.element_size()) - 1});
  // Equal strides merge exactly: the sums of two integer ranges form a range.
  std::sort(terms.begin(), terms.end(), [](const Term& x, const Term& y) { return x.stride > y.stride; });
  std::vector<Term> merged;
  for (const Term& t : terms) {
    if (!merged.empty() && merged.back().stride == t.stride) {
      merged.back().lo += t.lo;
      merged.back().hi += t.hi;
    } else {
      merged.push_back(t);
    }
  }
  return Search(std::move(merged), /*nonzero=*/false).solve(base_b - base_a);
}

}  // namespace detail
}  // namespace rotary
