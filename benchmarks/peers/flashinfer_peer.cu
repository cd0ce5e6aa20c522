// A benchmark peer, not part of rotary: FlashInfer's RoPE kernels (the
// header-only pos_enc.cuh of the pinned flashinfer-python wheel, unpacked by
// build_flashinfer.py) behind two torch ops, so the GPU benchmarks time them
// beside ours. Token-major tensors: [tokens, heads, head_dim], unit last
// stride, one stride per token and per head.
#include <flashinfer/pos_enc.cuh>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace {

void check_rows(const char* name, const at::Tensor& t, int64_t tokens) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 3 && t.stride(2) == 1, "flashinfer peer: ", name,
              " must be a CUDA [tokens, heads, head_dim] tensor with a unit last stride, got ", t.sizes(), " ",
              t.strides());
  TORCH_CHECK(t.size(0) == tokens, "flashinfer peer: ", name, " has ", t.size(0), " tokens, want ", tokens);
}

template <typename F>
void with_dtype(at::ScalarType t, F&& f) {
  if (t == at::kBFloat16) {
    f(__nv_bfloat16{});
  } else if (t == at::kHalf) {
    f(__half{});
  } else {
    TORCH_CHECK(false, "flashinfer peer: bfloat16 or float16 data, got ", t);
  }
}

void check_call(cudaError_t e) {
  TORCH_CHECK(e == cudaSuccess, "flashinfer peer: ", cudaGetErrorString(e));
}

// q_out, k_out = RoPE(q, k) at pos_ids; cos_sin_cache [positions, rotary_dim]
// float32, cos then sin per position (FlashInfer's table).
void rope(const at::Tensor& q, const at::Tensor& k, at::Tensor q_out, at::Tensor k_out,
          const at::Tensor& cos_sin_cache, const at::Tensor& pos_ids, bool interleave) {
  const int64_t n = q.size(0);
  for (auto [name, t] : {std::pair{"q", &q}, {"k", &k}, {"q_out", &q_out}, {"k_out", &k_out}}) check_rows(name, *t, n);
  TORCH_CHECK(pos_ids.scalar_type() == at::kLong && pos_ids.is_contiguous() && pos_ids.numel() == n,
              "flashinfer peer: pos_ids must be int64 [tokens]");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "flashinfer peer: cos_sin_cache must be contiguous float32");
  const c10::cuda::CUDAGuard guard(q.device());
  with_dtype(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    check_call(flashinfer::BatchQKApplyRotaryPosIdsCosSinCache<T, int64_t>(
        static_cast<T*>(q.data_ptr()), static_cast<T*>(k.data_ptr()), static_cast<T*>(q_out.data_ptr()),
        static_cast<T*>(k_out.data_ptr()), cos_sin_cache.data_ptr<float>(), pos_ids.data_ptr<int64_t>(), n,
        q.size(1), k.size(1), cos_sin_cache.size(1), q.size(2), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), interleave,
        at::cuda::getCurrentCUDAStream()));
  });
}

// FlashInfer's fused step: RoPE on q (to q_out, scaled and cast to the
// cache's dtype) and k, k and v appended to a paged NHD cache
// [pages, page_size, kv_heads, head_dim]. Token i goes to request
// batch_indices[i] at position positions[i] (pages kv_indices[kv_indptr[b]:]).
void rope_append_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor q_out,
                       at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& kv_indptr,
                       const at::Tensor& kv_indices, const at::Tensor& batch_indices, const at::Tensor& positions,
                       const at::Tensor& cos_sin_cache, const at::Tensor& pos_ids, bool interleave, double scale_q,
                       double scale_kv) {
  const int64_t n = q.size(0);
  for (auto [name, t] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}, {"q_out", &q_out}}) check_rows(name, *t, n);
  for (auto [name, t] : {std::pair{"kv_indptr", &kv_indptr}, {"kv_indices", &kv_indices},
                         {"batch_indices", &batch_indices}, {"positions", &positions}}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "flashinfer peer: ", name, " must be int32");
  }
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  q_out.scalar_type() == k_cache.scalar_type(),
              "flashinfer peer: contiguous k_cache and v_cache [pages, page_size, kv_heads, head_dim] of "
              "q_out's dtype");
  TORCH_CHECK(pos_ids.scalar_type() == at::kLong && pos_ids.numel() == n, "flashinfer peer: pos_ids int64 [tokens]");
  const uint32_t rope_dim = static_cast<uint32_t>(cos_sin_cache.size(1));
  TORCH_CHECK(rope_dim == q.size(2), "flashinfer peer: the whole head is rotated here");
  const c10::cuda::CUDAGuard guard(q.device());
  with_dtype(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto cache_tag) {
      using C = decltype(cache_tag);
      flashinfer::paged_kv_t<C, int32_t> paged(
          k_cache.size(2), k_cache.size(1), k_cache.size(3), kv_indptr.numel() - 1, flashinfer::QKVLayout::kNHD,
          static_cast<C*>(k_cache.data_ptr()), static_cast<C*>(v_cache.data_ptr()), kv_indices.data_ptr<int32_t>(),
          kv_indptr.data_ptr<int32_t>(), nullptr);
      check_call(flashinfer::RopeQuantizeAppendPagedKVCache<T, int64_t, int32_t, C>(
          static_cast<T*>(q.data_ptr()), static_cast<T*>(k.data_ptr()), nullptr, nullptr,
          static_cast<T*>(v.data_ptr()), static_cast<C*>(q_out.data_ptr()), nullptr, paged,
          batch_indices.data_ptr<int32_t>(), positions.data_ptr<int32_t>(), cos_sin_cache.data_ptr<float>(),
          pos_ids.data_ptr<int64_t>(), n, q.size(1), k.size(1), rope_dim, 0, q.stride(0), q.stride(1), 0, 0,
          q_out.stride(0), q_out.stride(1), 0, 0, k.stride(0), k.stride(1), 0, 0, v.stride(0), v.stride(1),
          static_cast<float>(scale_q), static_cast<float>(scale_kv), interleave, false,
          at::cuda::getCurrentCUDAStream()));
    };
    if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
      run(__nv_fp8_e4m3{});
    } else {
      TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "flashinfer peer: a cache of q's dtype or float8_e4m3fn");
      run(T{});
    }
  });
}

}  // namespace

TORCH_LIBRARY(rotary_peers, m) {
  m.def("flashinfer_rope(Tensor q, Tensor k, Tensor(a!) q_out, Tensor(b!) k_out, Tensor cos_sin_cache, "
        "Tensor pos_ids, bool interleave) -> ()");
  m.def("flashinfer_rope_append_paged(Tensor q, Tensor k, Tensor v, Tensor(a!) q_out, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor kv_indptr, Tensor kv_indices, Tensor batch_indices, Tensor positions, "
        "Tensor cos_sin_cache, Tensor pos_ids, bool interleave, float scale_q, float scale_kv) -> ()");
}

TORCH_LIBRARY_IMPL(rotary_peers, CUDA, m) {
  m.impl("flashinfer_rope", &rope);
  m.impl("flashinfer_rope_append_paged", &rope_append_paged);
}
