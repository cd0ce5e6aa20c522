// Python argument conversion for the _C module: dicts to RopeScaling and
// back, type-checked module options and call arguments. Every TypeError and
// ValueError names the user's argument.
#pragma once

#include <rotary/rotary.h>

#include <torch/python.h>

#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace rotary {
namespace python {

namespace py = pybind11;
using OptTensor = std::optional<torch::Tensor>;

// A value as an error shows it (typed: after its type's name); long lists
// and arrays by their length or shape.
std::string repr_of(py::handle v, bool typed = false);
rotary::RopeScaling scaling_from_dict(const py::dict& d, bool strict);
py::dict scaling_to_dict(const rotary::RopeScaling& s);
rotary::RopeScaling to_scaling(const py::object& obj, const char* who);
at::ScalarType angle_dtype_of(const py::object& obj, const char* who);
// An int (any integer type, not a bool), named in its TypeError / ValueError.
int64_t int_arg(const py::handle& v, const char* who, const char* name);
// A torch.dtype or a str argument, named in the TypeError (pybind's own
// errors name neither the argument nor what it got).
at::ScalarType dtype_arg(const py::handle& v, const char* who, const char* name);
std::string str_arg(const py::handle& v, const char* who, const char* name);
// A number (numbers.Real: any int or float type, not a bool) as a double: who's TypeError
// naming `name` for another type, its ValueError for an int past a double's
// range (the one check of it, for C++ and Python alike).
double float_arg(const py::handle& v, const char* who, const std::string& name);
// A bool, by name: pybind's bool takes None, 0 or numpy's bools.
bool bool_arg(const py::handle& v, const char* who, const char* name);
// A number as a double: a numbers.Real through float_arg (its error for one
// past a float's range), or a one-element real tensor; nullopt for a bool or
// anything else, for the caller to refuse in its own words.
std::optional<double> number_of(const py::handle& v, const char* who, const std::string& name);
// A list or tuple (None: no entries), each entry read by element(item,
// "name[i]"); an empty one is refused (it would read as None, which means
// none_means), else a TypeError naming what it should hold (`of`).
template <typename T, typename Element>
std::vector<T> list_arg(const py::handle& v, const char* who, const char* name, const char* of,
                        const char* none_means, Element element) {
  if (v.is_none()) return {};
  TORCH_CHECK_TYPE(
      (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)), who, ": ", name, " must be a list of ", of,
      " or None, got ", repr_of(v));
  TORCH_CHECK_VALUE(py::len(v) > 0, who, ": ", name, " must not be empty (None: ", none_means, "), got ", repr_of(v));
  std::vector<T> out;
  for (const auto item : v) out.push_back(element(item, std::string(name) + "[" + std::to_string(out.size()) + "]"));
  return out;
}
rotary::RotaryEmbeddingOptions options_from_py(
    const py::object& dim, const py::object& max_seq_len, const py::object& theta, const py::object& interleaved,
    const py::object& scaling, const py::object& angle_dtype);
// rotary_offset, mrope_section / mrope_interleaved, axes_* and pair_axes
// (None: unset), type checked and named; check_options (tables.cpp) checks
// how they combine.
rotary::RotaryEmbeddingOptions& nd_options_from_py(
    rotary::RotaryEmbeddingOptions& options, const py::object& rotary_offset, const py::object& mrope_section,
    const py::object& mrope_interleaved, const py::object& axes_dim, const py::object& axes_theta,
    const py::object& axes_shared_spectrum, const py::object& pair_axes);
// The constructor both module types take (RopeTables, CppRotaryEmbedding),
// with the Python module's arguments: make(options) builds the object.
template <typename Cls, typename Make>
void def_options_init(Cls& cls, Make make) {
  cls.def(
      py::init([make](const py::object& dim, const py::object& max_seq_len, const py::object& theta,
                      const py::object& interleaved, const py::object& scaling, const py::object& angle_dtype,
                      const py::object& rotary_offset, const py::object& mrope_section,
                      const py::object& mrope_interleaved, const py::object& axes_dim, const py::object& axes_theta,
                      const py::object& axes_shared_spectrum, const py::object& pair_axes) {
        auto options = options_from_py(dim, max_seq_len, theta, interleaved, scaling, angle_dtype);
        return make(nd_options_from_py(options, rotary_offset, mrope_section, mrope_interleaved, axes_dim,
                                       axes_theta, axes_shared_spectrum, pair_axes));
      }),
      py::arg("dim"), py::arg("max_seq_len") = 4096, py::arg("theta") = 10000.0, py::arg("interleaved") = true,
      py::arg("scaling") = py::none(), py::kw_only(), py::arg("angle_dtype") = "float64",
      py::arg("rotary_offset") = 0, py::arg("mrope_section") = py::none(), py::arg("mrope_interleaved") = false,
      py::arg("axes_dim") = py::none(), py::arg("axes_theta") = py::none(), py::arg("axes_shared_spectrum") = false,
      py::arg("pair_axes") = py::none());
}
py::object plain_int(const py::object& v);
int64_t start_pos_arg(const py::handle& v, const char* who = "RotaryEmbedding");
std::optional<torch::Tensor> tensor_arg(const py::handle& v, const std::string& who, const char* name);
// The same for an argument None does not stand for: "must be a tensor, got ...".
torch::Tensor required_tensor_arg(const py::handle& v, const std::string& who, const char* name);
std::tuple<torch::Tensor, OptTensor, int64_t, OptTensor, OptTensor> call_args(
    const py::object& q, const py::object& k, const py::object& start_pos, const py::object& offsets,
    const py::object& position_ids, const py::object& positions);
py::tuple options_to_tuple(const rotary::RopeTables& t);
py::object scaling_or_none(const rotary::RopeScaling& s);

// _load_from_state_dict of a bound C++ module (no children): torch's strict
// rule, every key under prefix other than `own` is unexpected (dotted ones
// too); and a saved entry as a tensor, else an error naming it.
void leaf_unexpected_keys(const py::dict& state_dict, const std::string& prefix, c10::ArrayRef<const char*> own,
                          py::list unexpected_keys);
std::optional<torch::Tensor> saved_tensor(const py::handle& v, const char* who, const char* name, py::list error_msgs);

// torch.nn.cpp.ModuleWrapper._apply casts every buffer with `fn`, which
// would bypass the C++ to(dtype) override when a Python parent is cast
// (parent.half(), parent.to(torch.bfloat16)): apply_moves_only takes only
// the device. rotary._cpp_wrappers.adopt fits each new instance with
// nn.Module's own methods and dicts that refuse assignment by name.
inline void adopt_wrapper(const py::object& self) {
  py::module_::import("rotary._cpp_wrappers").attr("adopt")(self);
}

template <typename Impl>
void apply_moves_only(py::object wrapper) {
  py::object init = wrapper.attr("__init__");
  wrapper.attr("__init__") = py::cpp_function(
      [init](const py::object& self, const py::args& args, const py::kwargs& kwargs) {
        init(self, *args, **kwargs);
        adopt_wrapper(self);
      },
      py::is_method(wrapper));
  wrapper.attr("__prepare_scriptable__") = py::module_::import("rotary._cpp_wrappers").attr("refuse_script");
  wrapper.attr("_apply") = py::cpp_function(
      [](py::object self, py::object fn, bool /*recurse*/) {
        auto impl = self.attr("cpp_module").cast<std::shared_ptr<Impl>>();
        const auto where = impl->buffers().front().device();
        // The Python module's reading of fn (rotary._cpp_wrappers.move_of).
        const py::object to = py::module_::import("rotary._cpp_wrappers").attr("move_of")(fn, py::cast(where));
        if (to.is_none()) {  // share_memory_: on the buffers themselves
          std::optional<rotary::KVCacheImpl::Writing> writing;  // it swaps a cache's storage under an append
          if constexpr (std::is_same_v<Impl, rotary::KVCacheImpl>) {
            writing.emplace(impl->begin_write("KVCache.share_memory"));
          }
          for (const auto& buffer : impl->buffers()) fn(py::cast(buffer));
          return self;
        }
        impl->to(to.template cast<torch::Device>());  // refuses meta by name
        return self;
      },
      py::is_method(wrapper), py::arg("fn"), py::arg("recurse") = true);
  // C++ clone() semantics (own buffers, state kept) as a module of this class.
  wrapper.attr("clone") = py::cpp_function(
      [](py::object self, py::object device) {
        py::object copy = py::module_::import("copy").attr("deepcopy")(self);
        return device.is_none() ? copy : copy.attr("to")(device);
      },
      py::is_method(wrapper), py::arg("device") = py::none());
}

// repr of a bound C++ module: its pretty_print, options included (torch's
// binding prints the class name only).
template <typename Impl>
void repr_from_pretty_print(py::object wrapper) {
  wrapper.attr("__repr__") = py::cpp_function(
      [](py::object self) {
        std::ostringstream os;
        self.attr("cpp_module").cast<std::shared_ptr<Impl>>()->pretty_print(os);
        return os.str();
      },
      py::is_method(wrapper));
}

// pickle / copy.deepcopy of a bound C++ module, named where users reach it
// (rotary): __reduce__ gives (m.<name>, (state_of(impl),)), and m.<name>
// rebuilds the object from that tuple with from_state.
template <typename Impl, typename StateOf, typename FromState>
void def_pickle(py::module_& m, py::object wrapper, const char* name, StateOf state_of, FromState from_state) {
  wrapper.attr("__module__") = "rotary";
  m.def(name, from_state, py::arg("state"));
  wrapper.attr("__reduce__") = py::cpp_function(
      [m, name, state_of](py::object self) {
        const auto impl = self.attr("cpp_module").cast<std::shared_ptr<Impl>>();
        return py::make_tuple(m.attr(name), py::make_tuple(state_of(*impl)));
      },
      py::is_method(wrapper));
}

// An N-D option read back: None when unset, as the Python module's, so that
// a module rebuilt from its own properties is the same (an empty list is refused).
inline py::object list_or_none(const std::vector<int64_t>& v) {
  return v.empty() ? py::object(py::none()) : py::object(py::cast(v));
}

// The options both modules' bindings read back as properties; options_of
// maps a bound object to its RotaryEmbeddingOptions.
template <typename Cls, typename OptionsOf>
void def_option_properties(Cls& cls, OptionsOf options_of) {
  using T = typename Cls::type;
  cls.def_property_readonly("dim", [options_of](const T& t) { return options_of(t).dim(); })
      .def_property_readonly("max_seq_len", [options_of](const T& t) { return options_of(t).max_seq_len(); })
      .def_property_readonly("theta", [options_of](const T& t) { return options_of(t).theta(); })
      .def_property_readonly("interleaved", [options_of](const T& t) { return options_of(t).interleaved(); })
      .def_property_readonly("scaling", [options_of](const T& t) { return scaling_or_none(options_of(t).scaling()); })
      .def_property_readonly(
          "angle_dtype", [options_of](const T& t) { return rotary::angle_dtype_name(options_of(t).angle_dtype()); })
      .def_property_readonly("rotary_offset", [options_of](const T& t) { return options_of(t).rotary_offset(); })
      .def_property_readonly("mrope_section",
                             [options_of](const T& t) { return list_or_none(options_of(t).mrope_section()); })
      .def_property_readonly(
          "mrope_interleaved", [options_of](const T& t) { return options_of(t).mrope_interleaved(); })
      .def_property_readonly("axes_dim", [options_of](const T& t) { return list_or_none(options_of(t).axes_dim()); });
}

// bind_kv_cache.cpp: rotary._C.KVCache, and the body of
// CppRotaryEmbedding.forward_with_cache (cache: a bound KVCache).
void bind_kv_cache(py::module_& m);
// bind_tables.cpp: rotary._C.RopeTables, the modules' state machine and shell.
void bind_tables(py::module_& m);
// The C++ cache behind a bound rotary.KVCache (a TypeError naming `who`
// for anything else), and an optional start_pos.
std::shared_ptr<rotary::KVCacheImpl> cache_of(const py::object& cache, const char* who);
std::optional<int64_t> optional_start_pos(const py::object& start_pos, const char* who);
// forward_with_cache's arguments from Python (both modules), each named
// when it has the wrong type.
struct CacheCall {
  torch::Tensor q, k, v;
  std::shared_ptr<rotary::KVCacheImpl> cache;
  std::optional<int64_t> start_pos;
  std::string layout;
};
CacheCall cache_call_args(const py::object& q, const py::object& k, const py::object& v, const py::object& cache,
                          const py::object& start_pos, const py::object& layout);
// bind_launch.cpp: rotary._C._cuda_launch_shape (the launch model).
void bind_launch(py::module_& m);
// bind_module.cpp: rotary._C.CppRotaryEmbedding.
void bind_cpp_module(py::module_& m);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> forward_with_cache(
    rotary::RotaryEmbeddingImpl& rope, const py::object& q, const py::object& k, const py::object& v,
    const py::object& cache, const py::object& start_pos, const py::object& layout);

}  // namespace python
}  // namespace rotary
