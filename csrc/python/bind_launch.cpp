// rotary._C._cuda_launch_shape, _cuda_kv_launch and _cuda_norm_launch: the
// CUDA launch one apply_rope_qk, apply_rope_with_kv_cache_ or
// apply_qk_norm_rope call would make, for the launch model
// (benchmarks/launch_model.py). They validate and describe the call exactly
// as the op does (prepare_rope, prepare_kv, prepare_norm_rope); no GPU
// needed. _cuda_set_l2_prefetch and _cuda_set_copy_blocks switch the
// launches' L2 prefetch and copy blocks.
#include "convert.h"
#include "checks/checks.h"
#include "checks/kv_checks.h"
#include "checks/norm_checks.h"
#include "params/launch_shape.h"

#include <torch/python.h>

namespace rotary {
namespace python {

void bind_launch(py::module_& m) {
  m.def("_cuda_set_l2_prefetch", &kernel::set_l2_prefetch, py::arg("on"),
        "Whether the CUDA RoPE launches prefetch each thread's next row into L2 (default on); returns the previous "
        "setting. For benchmarks that compare both.");
  m.def("_cuda_set_copy_blocks", &kernel::set_copy_blocks, py::arg("on"),
        "Whether a fused KV-cache launch whose rows fit in one wave copies v in blocks of its own, beside the "
        "rotation (default on), or in the rope rows after it; returns the previous setting. For benchmarks "
        "that compare both.");
  m.def(
      "_cuda_launch_shape",
      [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& freqs, bool interleaved,
         bool in_place, int64_t resident) {
        TORCH_CHECK_VALUE(resident >= 0, "_cuda_launch_shape: resident must be at least 0, got ", resident);
        const std::optional<torch::Tensor> none;
        const detail::RopeArgs args{0, interleaved, none, none, false, none, none, "BHSD"};
        const auto prepared = detail::prepare_rope("_cuda_launch_shape", q, &k, freqs, args, in_place);
        detail::check_cuda_extents("_cuda_launch_shape", prepared.params);
        return detail::cuda_launch_shape(prepared.params, q.scalar_type(), resident);
      },
      py::arg("q"), py::arg("k"), py::arg("freqs"), py::arg("interleaved") = true, py::arg("in_place") = false,
      py::arg("resident") = 0,
      "Fields of the CUDA launch (kernel::LaunchShape) for BHSD q and k, and with `resident` blocks resident on "
      "the device, 'blocks' (the grid); {} without CUDA kernels.");
  m.def(
      "_cuda_kv_launch",
      [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_cache,
         const torch::Tensor& v_cache, const torch::Tensor& freqs, int64_t start_pos,
         const std::optional<torch::Tensor>& slot_mapping, const std::string& kv_layout, int64_t resident,
         bool interleaved) {
        TORCH_CHECK_VALUE(resident >= 0, "_cuda_kv_launch: resident must be at least 0, got ", resident);
        const std::optional<torch::Tensor> none;
        const detail::RopeArgs args{start_pos, interleaved, none, none, false, none, none, "BHSD"};
        const detail::KVArgs kv{none, slot_mapping, kv_layout, none, none};
        const auto prepared = detail::prepare_kv("_cuda_kv_launch", q, k, v, k_cache, v_cache, freqs, args, kv);
        detail::check_cuda_extents("_cuda_kv_launch", prepared.params.rope, prepared.params.v_dim);
        return detail::cuda_kv_launch(prepared.params, q.scalar_type(), resident);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("freqs"),
      py::arg("start_pos") = 0, py::arg("slot_mapping") = py::none(), py::arg("kv_layout") = "BHSD",
      py::arg("resident") = 0, py::arg("interleaved") = true,
      "The CUDA launch apply_rope_with_kv_cache_ would make for BHSD q/k/v: the RoPE launch's fields, 'fused', "
      "'launches' and a fused launch's copy split (copy_lanes, copy_rows_per_block, copy_row_blocks) and round "
      "trips (rope_trips, row_copy_trips, copy_block_trips); with `resident` blocks resident on the device, "
      "'blocks' and 'copy_blocks' (0: the rope rows copy); {} without CUDA kernels.");
  m.def(
      "_cuda_norm_launch",
      [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& freqs, const std::string& norm,
         int64_t sms, bool interleaved, const std::optional<torch::Tensor>& q_fp8_scale) {
        TORCH_CHECK_VALUE(sms >= 1, "_cuda_norm_launch: sms must be at least 1, got ", sms);
        const std::optional<torch::Tensor> none;
        const detail::RopeArgs args{0, interleaved, none, none, false, none, none, "BHSD"};
        const detail::NormArgs nargs{none, none, 1e-6, norm, 0.0, q_fp8_scale};
        const auto prepared = detail::prepare_norm_rope("_cuda_norm_launch", q, k, freqs, args, nargs, false);
        detail::check_cuda_extents("_cuda_norm_launch", prepared.rope.params);
        return detail::cuda_norm_launch(prepared.rope.params, prepared.norm.params, q.scalar_type(), sms);
      },
      py::arg("q"), py::arg("k"), py::arg("freqs"), py::arg("norm") = "head", py::arg("sms") = 132,
      py::arg("interleaved") = true, py::arg("q_fp8_scale") = py::none(),
      "The CUDA launch apply_qk_norm_rope would make for BHSD q and k (q as fp8 with q_fp8_scale) on a GPU of "
      "`sms` SMs: rows, blocks, block_threads, batch, vector_items, vector_rotated, vector_lanes, "
      "vector_lane_heads, l2_prefetch and fp8_q; {} without CUDA kernels.");
}

}  // namespace python
}  // namespace rotary
