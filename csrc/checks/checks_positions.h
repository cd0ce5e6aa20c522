// By-value checks of host-side positions (checks_axes.cpp), shared by
// prepare_rope's 1-D and N-D paths.
#pragma once

#include "params/rope_params.h"

#include <ATen/core/Tensor.h>

#include <string>

namespace rotary {
namespace detail {

// Every token's position (offsets or ids, 1-D) lies in [0, 2^60) and, without
// inv_freq, inside the table; the message names the token and the argument.
// max_inv_freq: the largest |inv_freq| when it is on the host (else 0): a
// position past the table must keep its angle below 2^62 rad.
void check_positions_in_table(const char* op, const kernel::RopeParams& p, double max_inv_freq = 0);

// Past 2^62 rad no float64 angle keeps its phase (kernel::reduced_angle):
// a position past the table whose angle would pass it is an IndexError,
// raised by far_angle_error (the callers test, so a token's name is built
// only for the message).
inline bool keeps_phase(const kernel::RopeParams& p, int64_t pos, double max_inv_freq) {
  return pos < p.freqs_len || static_cast<double>(pos) * max_inv_freq < 0x1p62;
}
[[noreturn]] void far_angle_error(const char* op, int64_t pos, double max_inv_freq, const std::string& who);

// How a message names token (b, s): "token (batch b, seq s)", or for packed
// input "token s (sequence n, index i)" when cu_seqlens is on the host.
std::string token_name(const kernel::RopeParams& p, int64_t b, int64_t s, bool host_seqlens = true);

// start_pos in [0, 2^60): ValueError below, IndexError above, named by op.
void check_start_pos(const char* op, int64_t start_pos);

// An integer positions tensor as the kernels and the host rules read it:
// int32 and int64 as they are, every other integer dtype widened to int64
// once, before any arithmetic. A uint64 value >= 2^63 is refused on the host
// (it would wrap to a negative int64); on a device it becomes negative and so
// an invalid position (NaN, never an out-of-bounds read).
at::Tensor widen_positions(const char* op, const char* name, const at::Tensor& t);

// The deprecated positions= ids folded into start_pos + ids, in int64 and
// checked on the host first, so the sum cannot wrap.
at::Tensor legacy_ids(const char* op, const at::Tensor& ids, int64_t start_pos);

// The deprecated positions= argument had its meaning decided by rank alone:
// [batch, seq] ids ([total_tokens] when packed), else [] / [batch] offsets.
// The one definition; the Python wrappers and both modules read it.
bool legacy_positions_are_ids(int64_t dim, bool varlen);
// What its DeprecationWarning says after "who: ".
extern const char* const kLegacyPositionsWarning;

}  // namespace detail
}  // namespace rotary
