// A CPU tensor that the table builders fill through its data pointer.
// Allocated below the dispatcher: at::empty inside torch.func.grad / jvp (or
// a Python mode) would return a wrapper with no storage to write. The
// tensor is an inference tensor under inference mode, as at::empty's is.
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <string>

namespace rotary {
struct RopeFrequencies;
namespace detail {

inline at::Tensor host_tensor(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::Tensor(at::detail::empty_cpu(sizes, dtype));
}

// Tables are built on the host: one past its memory fails in the allocator
// (or, overcommitted, when written), one past int64 bytes in torch's size
// check; neither names the argument. `what` names the arguments, `entry`
// the element type, `advice` the way out (freqs.cpp).
void check_host_bytes(const char* who, std::initializer_list<int64_t> dims, uint64_t entry_bytes, const char* entry,
                      const std::string& what, const char* advice);

// freqs_table whose memory refusal the caller words: a module's grown table
// is not sized by a max_seq_len, so "pass a smaller max_seq_len" misleads.
at::Tensor freqs_table_worded(const RopeFrequencies& freqs, int64_t rows, at::ScalarType angle_dtype,
                              const std::string& what, const char* advice);

}  // namespace detail
}  // namespace rotary
