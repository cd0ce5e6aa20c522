// rotary._C.KVCache (the C++ rotary::KVCache through torch's module
// wrapper) and CppRotaryEmbedding.forward_with_cache.
#include "convert.h"

#include <rotary/rotary.h>

#include <torch/python.h>

#include <memory>
#include <sstream>
#include <string>

namespace rotary {
namespace python {

void bind_kv_cache(py::module_& m) {
  using Impl = rotary::KVCacheImpl;
  torch::python::bind_module<Impl>(m, "KVCache")
      .def(
          py::init([](int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, const std::string& layout,
                      const py::object& dtype, double k_scale, double v_scale) {
            return std::make_shared<Impl>(rotary::KVCacheOptions(batch, kv_heads, capacity, head_dim)
                                              .layout(layout)
                                              .dtype(torch::python::detail::py_object_to_dtype(dtype))
                                              .k_scale(k_scale)
                                              .v_scale(v_scale));
          }),
          py::arg("batch"), py::arg("kv_heads"), py::arg("capacity"), py::arg("head_dim"), py::kw_only(),
          py::arg("layout") = "BHSD", py::arg("dtype") = py::module_::import("torch").attr("float32"),
          py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0)
      .def_property_readonly("_length", &Impl::length)
      .def_property_readonly("capacity", [](const Impl& self) { return self.options.capacity(); })
      .def_property_readonly("layout", [](const Impl& self) { return self.options.layout(); })
      .def("truncate", &Impl::truncate, py::arg("length"))
      .def(
          "keys_values",
          [](const Impl& self, const py::object& dtype) {
            return self.keys_values(torch::python::detail::py_object_to_dtype(dtype));
          },
          py::arg("dtype") = py::module_::import("torch").attr("float32"),
          "The filled part as [batch, kv_heads, length, head_dim] (float8 caches dequantised into dtype).");
  // torch's ModuleWrapper copies attributes once, at construction; length
  // changes with every append, so the wrapper reads it from the C++ module.
  py::object wrapper = m.attr("KVCache");
  wrapper.attr("length") = py::module_::import("builtins").attr("property")(py::cpp_function(
      [](py::object self) { return self.attr("cpp_module").attr("_length"); }, py::is_method(wrapper)));
  wrapper.attr("__repr__") = py::cpp_function(
      [](py::object self) {
        std::ostringstream os;
        self.attr("cpp_module").cast<std::shared_ptr<Impl>>()->pretty_print(os);
        return os.str();
      },
      py::is_method(wrapper));
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> forward_with_cache(
    rotary::RotaryEmbeddingImpl& rope, torch::Tensor q, torch::Tensor k, const torch::Tensor& v, const py::object& cache,
    std::optional<int64_t> start_pos) {
  rotary::KVCache holder(cache.attr("cpp_module").cast<std::shared_ptr<rotary::KVCacheImpl>>());
  return rope.forward_with_cache(q, k, v, holder, start_pos);
}

}  // namespace python
}  // namespace rotary
