// The only translation unit that sees Python. The ops themselves are
// registered with the dispatcher by librotary; this module adds the table
// builder and the C++ RotaryEmbedding.
#include <rotary/rotary.h>

#include <torch/python.h>

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "rotary: C++ RotaryEmbedding and frequency tables (ops live in torch.ops.rotary)";

  m.def(
      "rope_freqs", &rotary::rope_freqs, py::arg("dim"), py::arg("max_seq_len"), py::arg("theta") = 10000.0,
      "complex64 [max_seq_len, dim // 2] table, angles computed in float64.");

  torch::python::bind_module<rotary::RotaryEmbeddingImpl>(m, "CppRotaryEmbedding")
      .def(
          py::init([](int64_t dim, int64_t max_seq_len, double theta, bool interleaved) {
            return std::make_shared<rotary::RotaryEmbeddingImpl>(
                rotary::RotaryEmbeddingOptions(dim).max_seq_len(max_seq_len).theta(theta).interleaved(
                    interleaved));
          }),
          py::arg("dim"), py::arg("max_seq_len") = 4096, py::arg("theta") = 10000.0,
          py::arg("interleaved") = true)
      .def(
          "forward",
          py::overload_cast<const torch::Tensor&, int64_t>(&rotary::RotaryEmbeddingImpl::forward),
          py::arg("x"), py::arg("start_pos") = 0)
      .def(
          "forward",
          py::overload_cast<const torch::Tensor&, const torch::Tensor&, int64_t>(
              &rotary::RotaryEmbeddingImpl::forward),
          py::arg("q"), py::arg("k"), py::arg("start_pos") = 0)
      // The table is reached as a buffer (module.freqs, state_dict()) through
      // torch.nn.cpp.ModuleWrapper, with the same name as in the Python module.
      .def_property_readonly("dim", [](const rotary::RotaryEmbeddingImpl& self) { return self.options.dim(); })
      .def_property_readonly(
          "max_seq_len", [](const rotary::RotaryEmbeddingImpl& self) { return self.options.max_seq_len(); })
      .def_property_readonly(
          "theta", [](const rotary::RotaryEmbeddingImpl& self) { return self.options.theta(); })
      .def_property_readonly(
          "interleaved", [](const rotary::RotaryEmbeddingImpl& self) { return self.options.interleaved(); });
}
