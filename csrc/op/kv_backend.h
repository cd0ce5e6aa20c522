// apply_rope_with_kv_cache_ for one backend, from that backend's launch
// function: validation and the no-write-before-checked rule are shared.
#pragma once

#include "checks/kv_checks.h"
#include "checks/norm_checks.h"
#include <rotary/op_args.h>

#include <ATen/DeviceGuard.h>
#include <torch/library.h>

namespace rotary {
namespace detail {

using RunKV = void (*)(const PreparedKV&, at::ScalarType);

template <RunKV Run>
void apply_rope_with_kv_cache_impl(ROTARY_KV_TENSORS ROTARY_KV_KERNEL_PARAMS) {
  const c10::OptionalDeviceGuard guard(at::device_of(q));
  const RopeArgs args{start_pos, interleaved, offsets,  position_ids, inverse,
                      cu_seqlens, inv_freq,   layout,  rotary_offset, pair_axes};
  const KVArgs kv{cache_positions, slot_mapping, kv_layout, k_scale, v_scale};
  const auto prepared = prepare_kv("apply_rope_with_kv_cache_", q, k, v, k_cache, v_cache, freqs, args, kv);
  if (prepared.params.rope.batch * prepared.params.rope.seq > 0) Run(prepared, q.scalar_type());
}

using RunNormKV = void (*)(const PreparedNormKV&, at::ScalarType);

template <RunNormKV Run>
void apply_qk_norm_rope_with_kv_cache_impl(ROTARY_KV_TENSORS ROTARY_KV_KERNEL_PARAMS ROTARY_NORM_KERNEL_PARAMS) {
  const c10::OptionalDeviceGuard guard(at::device_of(q));
  const RopeArgs args{start_pos, interleaved, offsets,  position_ids, inverse,
                      cu_seqlens, inv_freq,   layout,  rotary_offset, pair_axes};
  const KVArgs kv{cache_positions, slot_mapping, kv_layout, k_scale, v_scale};
  const auto prepared = prepare_norm_kv(
      "apply_qk_norm_rope_with_kv_cache_", q, k, v, k_cache, v_cache, freqs, args, kv, {ROTARY_NORM_NAME_LIST});
  const auto& p = prepared.kv.params.rope;
  if (p.batch * p.seq > 0) Run(prepared, q.scalar_type());
}

}  // namespace detail
}  // namespace rotary
