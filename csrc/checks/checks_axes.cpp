// The checks and launch fields of rotary_offset and of N-D positions
// (pair_axes), and the by-value checks of host positions, next to the shared
// validator in checks.cpp.
#include "checks.h"
#include "checks_positions.h"

#include <rotary/axes.h>
#include <rotary/bounds.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace rotary {
namespace detail {

void check_rotary_span(const char* op, const c10::SymInt& head_dim, const at::Tensor& freqs, const RopeArgs& args) {
  const int64_t offset = args.rotary_offset;
  const auto rotary_dim = freqs.sym_size(1) * 2;
  TORCH_CHECK_VALUE(offset >= 0, op, ": rotary_offset must be >= 0, got ", offset);
  TORCH_CHECK_VALUE(
      bounds::span_fits(offset, rotary_dim, head_dim), op, ": rotary_offset + rotary_dim must fit in head_dim = ",
      head_dim, " (the rotated dims are [rotary_offset, rotary_offset + rotary_dim)), got rotary_offset = ", offset,
      " and rotary_dim = ", rotary_dim, " (from freqs ", freqs.sym_sizes(), ")");
}

void check_axes_positions(const char* op, const at::Tensor& q_view, const at::Tensor& freqs, const RopeArgs& args) {
  const auto axes = *args.pair_axes;
  const bool varlen = args.cu_seqlens.has_value();
  const char* shapes = varlen ? "[n_axes, total_tokens]" : "[n_axes, seq_len] or [n_axes, batch, seq_len]";
  TORCH_CHECK_VALUE(
      args.position_ids.has_value(), op, ": pair_axes needs position_ids with a leading axis dim ", shapes,
      args.offsets ? "; offsets carry no axes" : "");
  const auto pairs = freqs.sym_size(1);
  TORCH_CHECK_VALUE(
      pairs == static_cast<int64_t>(axes.size()), op, ": pair_axes must have one axis per pair, rotary_dim / 2 = ",
      pairs, " entries, got ", axes.size());
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(axes.size()) <= kernel::kMaxPairs, op, ": pair_axes supports at most ",
      kernel::kMaxPairs, " pairs (rotary_dim <= ", 2 * kernel::kMaxPairs, "), got ", axes.size());
  const at::Tensor& p = *args.position_ids;
  TORCH_CHECK_VALUE(
      p.dim() == 2 || (!varlen && p.dim() == 3), op, ": with pair_axes, position_ids must have shape ", shapes,
      " (a leading axis dim), got ", p.sym_sizes());
  check_axis_indices(op, axes);
  const int64_t top = axes.empty() ? 0 : *std::max_element(axes.begin(), axes.end());
  TORCH_CHECK_VALUE(
      p.sym_size(0) == top + 1, op, ": position_ids has ", p.sym_size(0), " axes (its leading dim, shape ",
      p.sym_sizes(), ") but pair_axes (a module's mrope_section, axes_dim or pair_axes) uses axes 0..", top, "; the axis counts must match (n_axes = ", top + 1, ")");
  const auto batch = q_view.sym_size(0);
  const auto seq = q_view.sym_size(2);
  if (p.dim() == 2) {
    TORCH_CHECK_VALUE(
        p.sym_size(1) == seq, op, ": with pair_axes, position_ids must have shape ", shapes, " with n_axes = ",
        top + 1, " and ", varlen ? "total_tokens" : "seq_len", " = ", seq, "; got ", p.sym_sizes());
  } else {
    TORCH_CHECK_VALUE(
        (p.sym_size(1) == batch || p.sym_size(1) == 1) && (p.sym_size(2) == seq || p.sym_size(2) == 1), op,
        ": with pair_axes, position_ids must have shape ", shapes, " with n_axes = ", top + 1, ", batch = ", batch,
        " and seq_len = ", seq, "; got ", p.sym_sizes());
  }
}

void fill_axes(kernel::RopeParams& p, const at::Tensor& pos, at::IntArrayRef axes) {
  p.num_axes = pos.size(0);
  p.pos_stride_axis = pos.size(0) > 1 ? pos.stride(0) : 0;
  p.pos_stride_b = pos.dim() == 3 && pos.size(1) > 1 ? pos.stride(1) : 0;
  p.pos_stride_s = pos.size(-1) > 1 ? pos.stride(-1) : 0;
  for (size_t j = 0; j < axes.size(); ++j) p.pair_axis[j] = static_cast<uint8_t>(axes[j]);
}

std::string token_name(const kernel::RopeParams& p, int64_t b, int64_t s, bool host_seqlens) {
  if (p.cu_seqlens == nullptr) return "token (batch " + std::to_string(b) + ", seq " + std::to_string(s) + ")";
  if (!host_seqlens) return "token " + std::to_string(s) + " of the packed batch";
  const int64_t n = kernel::sequence_of(p, s);
  return "token " + std::to_string(s) + " (sequence " + std::to_string(n) + ", index " +
      std::to_string(s - kernel::cu_seqlen(p, n)) + ")";
}

void far_angle_error(const char* op, int64_t pos, double max_inv_freq, const std::string& who) {
  TORCH_CHECK_INDEX(
      false, op, ": ", who, " has position ", pos, ", past the table, where inv_freq up to ", max_inv_freq,
      " turns it by ", static_cast<double>(pos) * max_inv_freq, " rad; float64 angles keep their phase below 2^62 rad");
  __builtin_unreachable();
}

// The batch rows whose positions may differ: one when every row reads the
// same positions (none, or a batch stride of 0), so that an empty call with a
// huge batch checks one row (packed tokens, cu_seqlens, are one row).
static int64_t distinct_rows(const kernel::RopeParams& p) {
  const bool same = p.positions == nullptr || p.pos_stride_b == 0;
  return same ? std::min<int64_t>(p.batch, 1) : p.batch;
}

void check_positions_in_table(const char* op, const kernel::RopeParams& p, double max_inv_freq) {
  const char* name = p.positions_are_offsets ? "offsets" : "position_ids";
  const std::string from = p.positions == nullptr ? std::string(" (start_pos ") + std::to_string(p.start_pos) + " + s)"
      : p.positions_are_offsets ? std::string(" (start_pos ") + std::to_string(p.start_pos) + " + offsets + s)"
                                : std::string(" (position_ids)");
  const auto check = [&](int64_t b, int64_t s) {
    const int64_t sequence = p.cu_seqlens ? kernel::sequence_of(p, s) : b;  // one search for a packed token
    if (p.positions) {
      // Bounded so that start_pos + position + local index cannot overflow.
      const int64_t given = kernel::entry_of(p, b, s, sequence);
      TORCH_CHECK_INDEX(
          bounds::position_in_range(given), op, ": ", name, " must lie in (-2^60, 2^60), got ",
          given);
    }
    const int64_t pos = kernel::place_of(p, b, s, sequence).pos;  // given its sequence: no second search
    TORCH_CHECK_VALUE(
        pos >= 0, op, ": ", token_name(p, b, s), " has negative position ", pos, from);
    TORCH_CHECK_INDEX(
        pos < kMaxPosition, op, ": ", token_name(p, b, s), " has position ", pos, from, "; positions must be < 2^60");
    if (!keeps_phase(p, pos, max_inv_freq)) far_angle_error(op, pos, max_inv_freq, token_name(p, b, s));
    TORCH_CHECK_INDEX(
        p.inv_freq != nullptr || pos < p.freqs_len, op, ": ", token_name(p, b, s), " has position ", pos, from, ", outside the freqs table [0, ", p.freqs_len, "); build the table with max_seq_len > ", pos,
        " (the ops also take inv_freq)");
  };
  // Token (b, s) passes every check above. Only a call that is refused
  // reaches a failing token, so the exceptions cost nothing otherwise.
  const auto fits = [&](int64_t b, int64_t s) {
    try {
      check(b, s);
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  };
  // Offsets, or ids broadcast over seq: a row's positions rise with s, so
  // its first token holds its lowest and the rest fail, if at all, from one
  // token on; a search finds that token (an empty call of a huge seq_len
  // must not walk every token). Past 2^61 every token fails (|offset| <
  // 2^60), so the search stays where no position overflows.
  const bool rising = p.cu_seqlens == nullptr && p.pos_stride_s == 0;
  const int64_t rows = distinct_rows(p);
  for (int64_t b = 0; b < rows; ++b) {
    if (!rising) {
      for (int64_t s = 0; s < p.seq; ++s) check(b, s);
      continue;
    }
    check(b, 0);
    int64_t lo = 0, hi = std::min<int64_t>(p.seq - 1, int64_t{1} << 61);  // fits(lo)
    if (fits(b, hi)) continue;
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (fits(b, mid) ? lo : hi) = mid;
    }
    check(b, hi);  // raises
  }
}

void check_start_pos(const char* op, int64_t start_pos) {
  TORCH_CHECK_VALUE(start_pos >= 0, op, ": start_pos must be >= 0, got ", start_pos);
  TORCH_CHECK_INDEX(bounds::start_pos_in_range(start_pos), op, ": start_pos must be < 2^60, got ", start_pos);
}

at::Tensor widen_positions(const char* op, const char* name, const at::Tensor& t) {
  const auto type = t.scalar_type();
  // Non-integer dtypes are the callers' to refuse, with their own words.
  if (type == at::kLong || type == at::kInt || !at::isIntegralType(type, /*includeBool=*/false)) return t;
  if (type == at::kUInt64 && t.is_cpu() && t.numel() > 0) {
    const at::Tensor as_signed = t.view(at::kLong).flatten();  // the same bits
    const at::Tensor past = as_signed.lt(0);
    if (past.any().item<bool>()) {
      const int64_t i = past.to(at::kByte).argmax().item<int64_t>();
      const auto value = static_cast<uint64_t>(as_signed[i].item<int64_t>());
      TORCH_CHECK_INDEX(false, op, ": ", name, " must lie in (-2^60, 2^60), got ", value, " (uint64)");
    }
  }
  return t.to(at::kLong);
}

at::Tensor legacy_ids(const char* op, const at::Tensor& ids, int64_t start_pos) {
  TORCH_CHECK_TYPE(
      at::isIntegralType(ids.scalar_type(), /*includeBool=*/false), op, ": positions must have an integer dtype, got ",
      ids.scalar_type());
  check_start_pos(op, start_pos);
  const at::Tensor wide = widen_positions(op, "positions", ids).to(at::kLong);
  if (wide.is_cpu() && wide.numel() > 0) {
    const int64_t lo = wide.min().item<int64_t>(), hi = wide.max().item<int64_t>();
    for (const int64_t v : {lo, hi}) {
      TORCH_CHECK_INDEX(bounds::position_in_range(v), op, ": positions must lie in (-2^60, 2^60), got ", v);
    }
  }
  return start_pos == 0 ? wide : wide + start_pos;
}

bool legacy_positions_are_ids(int64_t dim, bool varlen) {
  return varlen ? dim == 1 : dim >= 2;
}

const char* const kLegacyPositionsWarning =
    "positions= is deprecated and will be removed in the next release; pass offsets= ([] or [batch]: position "
    "start_pos + offsets[b] + s) or position_ids= ([seq] or [batch, seq]: absolute positions, as in Hugging Face)";

void check_axes_in_table(const char* op, const kernel::RopeParams& p, const double* axis_max) {
  bool read[kernel::kMaxAxes] = {};  // an axis no pair turns by is never read: no row of the table for it
  for (int64_t j = 0; j < p.rotary_dim / 2; ++j) read[p.pair_axis[j]] = true;
  // N-D ids are absolute: a stride of 0 repeats one position along seq too.
  const int64_t rows = distinct_rows(p), seq = p.pos_stride_s == 0 ? std::min<int64_t>(p.seq, 1) : p.seq;
  for (int64_t a = 0; a < p.num_axes; ++a) {
    for (int64_t b = 0; b < rows; ++b) {
      for (int64_t s = 0; s < seq; ++s) {
        const int64_t pos = kernel::given_position(p, b, s, a);
        TORCH_CHECK_INDEX(
            bounds::position_in_range(pos), op, ": position_ids must lie in (-2^60, 2^60), got ", pos);
        TORCH_CHECK_VALUE(
            pos >= 0, op, ": ", token_name(p, b, s), " has negative position ", pos, " on axis ", a,
            " (position_ids)");
        if (!keeps_phase(p, pos, axis_max[a])) far_angle_error(op, pos, axis_max[a], token_name(p, b, s));
        TORCH_CHECK_INDEX(
            !read[a] || p.inv_freq != nullptr || pos < p.freqs_len, op, ": ", token_name(p, b, s), " has position ", pos,
            " on axis ", a, " (position_ids), outside the freqs table [0, ", p.freqs_len,
            "); build the table with max_seq_len > ", pos, " (the ops also take inv_freq)");
      }
    }
  }
}

}  // namespace detail
}  // namespace rotary
