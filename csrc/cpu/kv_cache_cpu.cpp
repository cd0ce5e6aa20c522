// CPU apply_rope_with_kv_cache_: q and k rotate in place with the RoPE
// kernel (rope_cpu.cpp), then each token's k and v rows go to the cache,
// in parallel over tokens. The rotation is the one apply_rope_qk_ runs, so
// the cache holds the same bits as the unfused sequence.
#include "rope_cpu.h"

#include "../kv_backend.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

namespace rotary {
namespace {

using kernel::KVCacheParams;

// A head row moves with one memcpy when both sides are dense along head_dim
// and the cache has the input's dtype; anything else goes element by element.
template <typename T, typename Cache>
void write_token(const KVCacheParams& p, int64_t b, int64_t s) {
  int64_t outer = 0, inner = 0;
  if (!kernel::cache_row(p, b, s, outer, inner)) return;  // slot -1
  const auto& r = p.rope;
  const int64_t dim = r.head_dim;
  const bool rows = std::is_same<T, Cache>::value && r.k.out_stride[3] == 1 && p.v_stride[3] == 1 &&
      p.kc_stride[3] == 1 && p.vc_stride[3] == 1;
  for (int64_t h = 0; h < r.k.heads; ++h) {
    if (rows) {
      const T* k = static_cast<const T*>(r.k.out) + b * r.k.out_stride[0] + h * r.k.out_stride[1] + s * r.k.out_stride[2];
      const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + h * p.v_stride[1] + s * p.v_stride[2];
      T* kc = static_cast<T*>(p.k_cache) + outer * p.kc_stride[0] + h * p.kc_stride[1] + inner * p.kc_stride[2];
      T* vc = static_cast<T*>(p.v_cache) + outer * p.vc_stride[0] + h * p.vc_stride[1] + inner * p.vc_stride[2];
      std::memcpy(kc, k, dim * sizeof(T));
      std::memcpy(vc, v, dim * sizeof(T));
    } else {
      for (int64_t d = 0; d < dim; ++d) kernel::write_kv_element<T, Cache>(p, b, s, h, d, outer, inner);
    }
  }
}

template <typename T, typename Cache>
void write_cache(const KVCacheParams& p) {
  const int64_t seq = p.rope.seq;
  const int64_t per_token = 2 * p.rope.k.heads * p.rope.head_dim;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(per_token, 1));
  at::parallel_for(0, p.rope.batch * seq, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) write_token<T, Cache>(p, t / seq, t % seq);
  });
}

void run_cpu(const detail::PreparedKV& prepared, at::ScalarType dtype) {
  cpu::rope_cpu(prepared.params.rope, dtype);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_kv_cache_cpu", [&] {
    if (prepared.params.fp8) {
      write_cache<scalar_t, uint8_t>(prepared.params);
    } else {
      write_cache<scalar_t, scalar_t>(prepared.params);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, CPU, m) {
  m.impl("apply_rope_with_kv_cache_", &detail::apply_rope_with_kv_cache_impl<&run_cpu>);
}

}  // namespace rotary
