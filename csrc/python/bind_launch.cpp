// rotary._C._cuda_launch_shape: the CUDA launch one apply_rope_qk call would
// make, for the launch model (benchmarks/launch_model.py). It validates and
// describes the call exactly as the op does (prepare_rope); no GPU needed.
#include "convert.h"
#include "checks/checks.h"
#include "params/launch_shape.h"

#include <torch/python.h>

namespace rotary {
namespace python {

void bind_launch(py::module_& m) {
  m.def(
      "_cuda_launch_shape",
      [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& freqs, bool interleaved,
         bool in_place) {
        const std::optional<torch::Tensor> none;
        const detail::RopeArgs args{0, interleaved, none, none, false, none, none, "BHSD"};
        const auto prepared = detail::prepare_rope("_cuda_launch_shape", q, &k, freqs, args, in_place);
        return detail::cuda_launch_shape(prepared.params, q.scalar_type());
      },
      py::arg("q"), py::arg("k"), py::arg("freqs"), py::arg("interleaved") = true, py::arg("in_place") = false,
      "Fields of the CUDA launch (kernel::LaunchShape) for BHSD q and k; {} without CUDA kernels.");
}

}  // namespace python
}  // namespace rotary
