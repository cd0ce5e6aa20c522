// check_saved_tables: saved freqs / inv_freq against a module's options,
// and the state of the rule they were saved in.
#include <rotary/bounds.h>
#include <rotary/freqs.h>
#include <rotary/tables.h>

#include "checks/checks.h"
#include "module/tables_detail.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace rotary {

using detail::check_options;
using detail::describe_options;
using detail::frequencies_of;
using detail::rows_for;
using detail::with_defaults;

int64_t check_saved_tables(
    const RotaryEmbeddingOptions& options,
    const std::optional<at::Tensor>& freqs,
    const std::optional<at::Tensor>& inv_freq,
    const std::string& who,
    std::optional<int64_t> tried) {
  check_options(options);
  const bool has_freqs = freqs && freqs->defined();
  const bool has_inv = inv_freq && inv_freq->defined();
  for (const auto& [name, t] : {std::make_pair("freqs", freqs), std::make_pair("inv_freq", inv_freq)}) {
    if (t) detail::check_dense(who.c_str(), (std::string("the saved '") + name + "'").c_str(), *t);  // sizes first
    TORCH_CHECK_VALUE(
        !(t && t->defined() && t->is_meta()), who, ": the saved '", name,
        "' is a meta tensor (it has no values to check); load a state_dict with real tensors");
  }
  const RotaryEmbeddingOptions full = with_defaults(options);
  const RopeScaling& s = full.scaling();
  const RopeType type = rope_type_of(s);
  validate(s, options.dim());
  const int64_t pairs = options.dim() / 2;
  const std::string desc = describe_options(options);
  const std::string hint =
      "; it was saved from a module with other options: build this one with those (theta, max_seq_len, "
      "scaling, angle_dtype), or leave 'freqs' and 'inv_freq' out of what you load";

  at::Tensor f_saved, inv_saved;
  int64_t rows = 0;
  if (has_freqs) {
    TORCH_CHECK_VALUE(
        freqs->scalar_type() == at::kComplexFloat && freqs->dim() == 2 && freqs->size(1) == pairs, who,
        ": the saved 'freqs' must be complex64 [rows, dim / 2] = [*, ", pairs, "], got ", freqs->scalar_type(), " ",
        freqs->sizes(), " (module: ", desc, ")");
    rows = freqs->size(0);
    const bool grows = type == RopeType::Dynamic;
    TORCH_CHECK_VALUE(
        grows ? rows >= options.max_seq_len() || rows == 1 : rows == options.max_seq_len(), who,
        ": the saved 'freqs' has ",
        rows, " rows but this module's max_seq_len is ", options.max_seq_len(), " (", desc, ")", hint);
    f_saved = freqs->detach().to(at::kCPU).resolve_conj().resolve_neg().contiguous();  // the values it shows
  }
  if (has_inv) {
    TORCH_CHECK_VALUE(
        inv_freq->scalar_type() == at::kDouble && inv_freq->dim() == 1 && inv_freq->size(0) == pairs, who,
        ": the saved 'inv_freq' must be float64 [dim / 2] = [", pairs, "], got ", inv_freq->scalar_type(), " ",
        inv_freq->sizes(), " (module: ", desc, ")");
    inv_saved = inv_freq->detach().to(at::kCPU).resolve_neg().contiguous();
  }
  if (!has_freqs && !has_inv) return 0;

  // The states the saved tables may be in: the initial one, longrope's long
  // factors, a grown dynamic base (its length recovered from inv_freq or
  // from the table's row count).
  // The frequencies of a state, or none for one the rule refuses (the
  // lengths past where a dynamic base leaves a double's range).
  const auto servable = [&](int64_t seq_len) -> std::optional<RopeFrequencies> {
    try {
      return frequencies_of(options, s, seq_len);
    } catch (const c10::ValueError&) {
      if (seq_len == 0) throw;
      return std::nullopt;
    }
  };
  std::vector<int64_t> states = {0};
  if (tried && *tried > 0 && depends_on_seq_len(s)) states.push_back(*tried);  // past what inv_freq recovers
  if (type == RopeType::LongRope) states.push_back(*s.original_max_position_embeddings() + 1);
  int64_t recovered = 0;  // a grown dynamic length read from inv_freq (0: none)
  if (type == RopeType::Dynamic) {
    const int64_t m = *s.max_position_embeddings();
    if (has_freqs && rows > options.max_seq_len()) states.push_back(rows);
    const double* inv = has_inv ? inv_saved.const_data_ptr<double>() : nullptr;
    const int64_t j = pairs - 1;  // the last pair: inv[j] moves as 1 / L, so it tells L apart best
    if (inv && j >= 1 && std::isfinite(inv[j]) && inv[j] > 0.0) {
      // The rule's inv_freq falls as L grows: the length whose last entry is
      // nearest the saved one, by bisection (a closed-form inverse misses by
      // ~40 ulps of L: pow's rounded exponents, times log(base)). Neighbours
      // within a few ulps may pass the 1e-12 check too, and the exact
      // inv_freq (sorted first below) tells them apart; past 2^53 they share
      // one double L, one table, and the nearest wins.
      // A length past those the rule serves (a base past a double's range) counts as past the saved one.
      const auto last = [&](int64_t c) {
        const auto f = servable(c);
        return f ? f->inv_freq[j] : 0.0;
      };
      int64_t lo = m + 1, hi = std::max(lo, kMaxPosition);
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (last(mid) > inv[j]) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      recovered = lo;
      for (int64_t c = lo - 16; c <= lo + 16; ++c) {
        if (c > m) states.push_back(c);
      }
    }
  }
  // Each state's frequencies, computed once.
  std::vector<std::pair<int64_t, RopeFrequencies>> candidates;
  for (const int64_t st : states) {
    if (auto f = servable(st)) candidates.emplace_back(st, std::move(*f));
  }
  if (has_inv && candidates.size() > 1) {
    const double* a = inv_saved.const_data_ptr<double>();
    const auto inv_error = [&](const RopeFrequencies& f) {
      double worst = 0.0;
      for (int64_t j = 0; j < pairs; ++j) {
        const double e = std::abs(a[j] - f.inv_freq[j]) / std::abs(f.inv_freq[j]);
        worst = std::isnan(e) ? std::numeric_limits<double>::infinity() : std::max(worst, e);
      }
      return worst;
    };
    std::vector<double> error(candidates.size());
    for (size_t i = 0; i < candidates.size(); ++i) error[i] = inv_error(candidates[i].second);
    std::vector<size_t> order(candidates.size());
    std::iota(order.begin(), order.end(), size_t{0});
    // Among equal tables, the state a copy carries (tried), else the nearest to inv_freq's.
    const int64_t anchor = tried && *tried > 0 ? *tried : recovered;
    const auto distance = [&](size_t i) { return anchor ? std::abs(candidates[i].first - anchor) : 0; };
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
      return error[x] < error[y] || (error[x] == error[y] && distance(x) < distance(y));
    });
    std::vector<std::pair<int64_t, RopeFrequencies>> ranked;
    for (const size_t i : order) ranked.push_back(std::move(candidates[i]));
    candidates = std::move(ranked);
  }

  std::string first_mismatch;
  for (const auto& [seq_len, f] : candidates) {
    std::ostringstream why;
    bool ok = true;
    if (has_inv) {
      const double* a = inv_saved.const_data_ptr<double>();
      for (int64_t j = 0; j < pairs && ok; ++j) {
        const double b = f.inv_freq[j];
        if (!(std::abs(a[j] - b) <= 1e-12 * std::abs(b))) {
          ok = false;
          why.precision(17);
          why << "'inv_freq'[" << j << "] = " << a[j] << " but these options give " << b;
        }
      }
    }
    if (ok && has_freqs) {
      if (rows_for(full, seq_len) != rows) {
        ok = false;
        why << "'freqs' has " << rows << " rows, this state of the rule has " << rows_for(full, seq_len);
      } else {
        const at::Tensor expected = freqs_table(f, rows, options.angle_dtype());
        const at::Tensor diff = at::nan_to_num((f_saved - expected).abs(), std::numeric_limits<double>::infinity());
        const double tol = detail::table_tolerance(f.attention_scaling);
        if (diff.numel() > 0) {
          const int64_t worst = diff.flatten().argmax().item<int64_t>();
          const double err = diff.flatten()[worst].item<double>();
          // Within the tolerance but nearer to the other angle_dtype's table:
          // saved from a module with the other angle_dtype.
          double err_other = std::numeric_limits<double>::infinity();
          const auto other = options.angle_dtype() == at::kFloat ? at::kDouble : at::kFloat;
          if (err > 0.0 && err <= tol) {
            err_other = (f_saved - freqs_table(f, rows, other)).abs().max().item<double>();
          }
          if (err_other < err) {
            ok = false;
            why << "'freqs' is the table of angle_dtype=" << angle_dtype_name(other) << " (it differs by "
                << err_other << " from that one, by " << err << " from what these options build)";
          } else if (!(err <= tol)) {
            ok = false;
            const auto got = f_saved.flatten()[worst].item<c10::complex<float>>();
            const auto want = expected.flatten()[worst].item<c10::complex<float>>();
            why << "'freqs' row " << worst / pairs << ", pair " << worst % pairs << " differs by " << err
                << " from what these options build (saved " << got.real() << (got.imag() < 0 ? "" : "+")
                << got.imag() << "i, expected " << want.real() << (want.imag() < 0 ? "" : "+") << want.imag()
                << "i)";
          }
        }
      }
    }
    if (ok) return seq_len;
    if (first_mismatch.empty()) first_mismatch = why.str();
  }
  // A grown dynamic state shows in inv_freq, or in freqs' rows only past max_seq_len.
  const bool state_unknown = type == RopeType::Dynamic && !has_inv && rows <= options.max_seq_len();
  const std::string freqs_alone = "; 'freqs' alone, of " + std::to_string(rows) + " row(s), cannot tell a length "
      "this dynamic rule grew to from other options: load the saved 'inv_freq' with it, or build this module with "
      "the options it was saved with";
  TORCH_CHECK_VALUE(false, who, ": the saved tables do not match this module", state_unknown ? "'s initial state" : "",
                    " (", desc, "): ", first_mismatch, state_unknown ? freqs_alone : hint);
  return 0;
}

}  // namespace rotary
