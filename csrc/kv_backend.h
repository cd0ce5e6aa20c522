// apply_rope_with_kv_cache_ for one backend, from that backend's launch
// function: validation and the no-write-before-checked rule are shared.
#pragma once

#include "kv_checks.h"

#include <ATen/DeviceGuard.h>
#include <torch/library.h>

namespace rotary {
namespace detail {

using RunKV = void (*)(const PreparedKV&, at::ScalarType);

template <RunKV Run>
void apply_rope_with_kv_cache_impl(
    at::Tensor& q, at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& freqs, int64_t start_pos, bool interleaved, const std::optional<at::Tensor>& offsets,
    const std::optional<at::Tensor>& position_ids, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& inv_freq, c10::string_view layout, const std::optional<at::Tensor>& cache_positions,
    const std::optional<at::Tensor>& slot_mapping, c10::string_view kv_layout, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, bool inverse, int64_t rotary_offset, at::OptionalIntArrayRef pair_axes) {
  const c10::OptionalDeviceGuard guard(at::device_of(q));
  const RopeArgs args{start_pos, interleaved, offsets,  position_ids, inverse,
                      cu_seqlens, inv_freq,   layout,  rotary_offset, pair_axes};
  const KVArgs kv{cache_positions, slot_mapping, kv_layout, k_scale, v_scale};
  const auto prepared = prepare_kv("apply_rope_with_kv_cache_", q, k, v, k_cache, v_cache, freqs, args, kv);
  if (prepared.params.rope.batch * prepared.params.rope.seq > 0) Run(prepared, q.scalar_type());
}

}  // namespace detail
}  // namespace rotary
