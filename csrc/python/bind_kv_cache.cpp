// rotary._C.KVCache (the C++ rotary::KVCache through torch's module
// wrapper) and CppRotaryEmbedding.forward_with_cache.
#include "convert.h"

#include <rotary/rotary.h>

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/python.h>
#include <pybind11/stl.h>

#include <memory>
#include <sstream>
#include <string>

namespace rotary {
namespace python {

namespace {

using KVImpl = rotary::KVCacheImpl;

// torch.jit.trace, or fake tensors on this thread (a non-strict
// torch.export, a FakeTensorMode): each keeps what is read on the host as a
// constant (and a fake call must not advance a real cache).
// (torch.compiler.is_exporting() is process-wide: true for an eager call on
// another thread while one exports.)
bool traced_here() {
  return torch::jit::tracer::isTracing() ||
      c10::impl::TorchDispatchModeTLS::get_mode(c10::impl::TorchDispatchModeKey::FAKE).has_value();
}

torch::Tensor bytes_of(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat8_e4m3fn ? t.view(torch::kByte) : t;
}

// state_dict's '_extra_state': what the buffers do not say.
py::dict kv_extra_state(const KVImpl& impl) {
  py::dict d;
  d["length"] = impl.length();
  d["layout"] = impl.options_in_effect().layout();
  return d;
}

// load_state_dict: the buffers, length and layout through load_state, which
// checks them all before it copies any; torch's default would cast a saved
// buffer to this cache's dtype (float32 rows into a float8 cache, unscaled)
// and drop the length. A cache loads all of its state or none: torch passes
// strict=True here whatever the caller asked, so a partial state is an error.
void kv_load_from_state_dict(py::object self, py::object state_dict, const std::string& prefix,
                             py::object /*local_metadata*/, bool /*strict*/, py::list missing_keys,
                             py::list unexpected_keys, py::list error_msgs) {
  auto impl = self.attr("cpp_module").cast<std::shared_ptr<KVImpl>>();
  const py::dict sd(state_dict);
  const char* who = "KVCache.load_state_dict";
  const bool fp8 = impl->k_scale.defined();
  const char* names[5] = {"k", "v", "k_scale", "v_scale", "_extra_state"};
  py::object got[5];
  std::string present, absent;
  for (int i = 0; i < 5; ++i) {
    const py::str key(prefix + names[i]);
    if (sd.contains(key)) {
      got[i] = sd[key];
      present += std::string(present.empty() ? "" : ", ") + names[i];
    } else if (i < 2 || i == 4 || fp8) {
      missing_keys.append(key);
      absent += std::string(absent.empty() ? "" : ", ") + names[i];
    }
  }
  leaf_unexpected_keys(sd, prefix, names, unexpected_keys);
  if (present.empty()) return;  // nothing of this cache's: the missing keys say so
  if (!absent.empty()) {
    error_msgs.append(std::string(who) + ": the state has " + present + " but not " + absent +
                      "; a KVCache loads all of its state or none ('_extra_state' holds its length and layout)");
    return;
  }
  torch::Tensor saved[4];
  for (int i = 0; i < 4; ++i) {
    if (!got[i]) continue;
    const auto t = saved_tensor(got[i], who, names[i], error_msgs);
    if (!t) return;
    saved[i] = *t;
  }
  const py::object& extra = got[4];
  if (!py::isinstance<py::dict>(extra) || !extra.contains("length") || !extra.contains("layout")) {
    error_msgs.append(std::string(who) + ": the saved '_extra_state' must be a dict with 'length' and 'layout', got " +
                      repr_of(extra));
    return;
  }
  try {
    impl->load_state(saved[0], saved[1], saved[2], saved[3], int_arg(extra["length"], who, "_extra_state['length']"),
                     str_arg(extra["layout"], who, "_extra_state['layout']"), who);
  } catch (const c10::Error& e) {
    error_msgs.append(std::string(e.what_without_backtrace()));
  }
}

// A scale as a double (number_of: numpy's, a one-element tensor), no bool.
double scale_number(const py::handle& v, const std::string& name) {
  TORCH_CHECK_TYPE(!py::isinstance<py::bool_>(v), "KVCache: ", name, " must be a number, got ", repr_of(v));
  const auto d = number_of(v, "KVCache", name);
  TORCH_CHECK_TYPE(d, "KVCache: ", name, " must be a number, or a list of numbers (one per kv head), got ", repr_of(v));
  return *d;
}

// The constructor's k_scale / v_scale: None, a number (one scale) or a list
// of numbers (one per kv head), each named in its error.
void set_scale(const py::object& v, const char* name, std::optional<double>& one, std::vector<double>& heads) {
  if (v.is_none()) return;
  if (!py::isinstance<py::list>(v) && !py::isinstance<py::tuple>(v)) {
    one = scale_number(v, name);
    return;
  }
  heads = list_arg<double>(v, "KVCache", name, "numbers", "1", scale_number);
}

// The same, back from the options (pickle).
py::object scale_arg(const std::optional<double>& one, const std::vector<double>& heads) {
  if (!heads.empty()) return py::cast(heads);
  return one ? py::object(py::float_(*one)) : py::object(py::none());
}

}  // namespace

void bind_kv_cache(py::module_& m) {
  using Impl = KVImpl;
  torch::python::bind_module<Impl>(m, "KVCache")
      .def(
          py::init([](const py::object& batch, const py::object& kv_heads, const py::object& capacity,
                      const py::object& head_dim, const py::object& layout, const py::object& dtype,
                      const py::object& k_scale, const py::object& v_scale) {
            const char* who = "KVCache";
            auto options =
                rotary::KVCacheOptions(int_arg(batch, who, "batch"), int_arg(kv_heads, who, "kv_heads"),
                                       int_arg(capacity, who, "capacity"), int_arg(head_dim, who, "head_dim"))
                    .layout(str_arg(layout, who, "layout"))
                    .dtype(dtype_arg(dtype, who, "dtype"));
            set_scale(k_scale, "k_scale", options.k_scale(), options.k_head_scales());
            set_scale(v_scale, "v_scale", options.v_scale(), options.v_head_scales());
            return std::make_shared<Impl>(options);
          }),
          py::arg("batch"), py::arg("kv_heads"), py::arg("capacity"), py::arg("head_dim"), py::kw_only(),
          py::arg("layout") = "BHSD", py::arg("dtype") = py::module_::import("torch").attr("float32"),
          py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none())
      .def_property_readonly("_length", &Impl::length)
      .def_property_readonly("capacity", [](const Impl& self) { return self.options_in_effect().capacity(); })
      .def_property_readonly("layout", [](const Impl& self) { return self.options_in_effect().layout(); })
      .def(
          "truncate",
          [](Impl& self, const py::object& length) { self.truncate(int_arg(length, "KVCache.truncate", "length")); },
          py::arg("length"))
      .def("reset", &Impl::reset,
           "Fresh zero buffers (new storage: out of shared memory) and length 0; a cache forked mid-write: this "
           "process takes it over.")
      // The Python RotaryEmbedding.forward_with_cache, after its fused op wrote the rows.
      .def("_advance", &Impl::advance, py::arg("tokens"))
      .def(
          "keys_values",
          [](const Impl& self, const py::object& dtype) {
            TORCH_CHECK(!traced_here(), "KVCache.keys_values: it reads the cache's length on the host, which "
                        "torch.jit.trace, torch.export and a FakeTensorMode would keep as a constant (with the rows "
                        "filled then); run it eagerly or under torch.compile (one graph break), or trace attention "
                        "over cache tensors you own (docs/kv_cache.md)");
            return self.keys_values(dtype_arg(dtype, "KVCache.keys_values", "dtype"));
          },
          py::arg("dtype") = py::module_::import("torch").attr("float32"),
          "The filled part as [batch, kv_heads, length, head_dim] (float8 caches dequantised into dtype).");
  // torch's ModuleWrapper copies attributes once, at construction; length
  // changes with every append, so the wrapper reads it from the C++ module.
  py::object wrapper = m.attr("KVCache");
  wrapper.attr("length") = py::module_::import("builtins").attr("property")(py::cpp_function(
      [](py::object self) { return self.attr("cpp_module").attr("_length"); }, py::is_method(wrapper)));
  repr_from_pretty_print<Impl>(wrapper);
  // The cache keeps the dtype its options say when a parent is cast.
  apply_moves_only<Impl>(wrapper);
  // state_dict: the buffers, plus the length and layout as '_extra_state'.
  wrapper.attr("get_extra_state") = py::cpp_function(
      [](py::object self) { return kv_extra_state(*self.attr("cpp_module").cast<std::shared_ptr<Impl>>()); },
      py::is_method(wrapper));
  wrapper.attr("_load_from_state_dict") = py::cpp_function(
      &kv_load_from_state_dict, py::is_method(wrapper), py::arg("state_dict"), py::arg("prefix"),
      py::arg("local_metadata"), py::arg("strict"), py::arg("missing_keys"), py::arg("unexpected_keys"),
      py::arg("error_msgs"));
  // pickle / copy.deepcopy: rebuilt from the options, then the buffers (the
  // scales as the buffers hold them, not as built) and the length loaded in.
  // torch cannot pickle a float8 tensor: its bytes go.
  def_pickle<Impl>(
      m, wrapper, "_kv_cache_from_state",
      [](const Impl& impl) {
        const auto& o = impl.options_in_effect();  // what the buffers hold
        const py::object dtype = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(o.dtype())));
        auto or_none = [](const torch::Tensor& t) { return t.defined() ? py::cast(t) : py::object(py::none()); };
        return py::make_tuple(o.batch(), o.kv_heads(), o.capacity(), o.head_dim(), o.layout(), dtype,
                              scale_arg(o.k_scale(), o.k_head_scales()), scale_arg(o.v_scale(), o.v_head_scales()),
                              bytes_of(impl.k), bytes_of(impl.v), impl.length(), impl.is_training(),
                              or_none(impl.k_scale), or_none(impl.v_scale));
      },
      [wrapper](const py::tuple& st) {
        // 12 entries: pickled before the scale buffers travelled (their options' scales then).
        TORCH_CHECK_VALUE(st.size() == 14 || st.size() == 12, "KVCache: unexpected pickled state of size ", st.size());
        py::object obj = wrapper(
            st[0], st[1], st[2], st[3], py::arg("layout") = st[4], py::arg("dtype") = st[5], py::arg("k_scale") = st[6],
            py::arg("v_scale") = st[7]);
        auto impl = obj.attr("cpp_module").cast<std::shared_ptr<Impl>>();
        const auto k = st[8].cast<torch::Tensor>(), v = st[9].cast<torch::Tensor>();
        impl->to(k.device());
        const auto dt = impl->options.dtype();  // float8 travels as its bytes
        auto scale = [](const py::handle& h) { return h.is_none() ? torch::Tensor() : h.cast<torch::Tensor>(); };
        const bool scales = st.size() == 14;
        impl->load_state(k.view(dt), v.view(dt), scales ? scale(st[12]) : torch::Tensor(),
                         scales ? scale(st[13]) : torch::Tensor(), st[10].cast<int64_t>(), std::nullopt, "KVCache pickle");
        impl->train(st[11].cast<bool>());  // after nn.Module.__init__, which sets training = True
        return obj;
      });
}

// The C++ cache behind a bound rotary.KVCache; a TypeError naming the call for anything else.
std::shared_ptr<rotary::KVCacheImpl> cache_of(const py::object& cache, const char* who) {
  // Looked up once (a decode step calls this): the class lives as long as the module.
  static const py::handle wrapper = py::object(py::module_::import("rotary._C").attr("KVCache")).release();
  if (!py::isinstance(cache, wrapper)) {
    const py::handle type = py::type::of(cache);
    const bool raw = py::str(type.attr("__module__")).cast<std::string>() == "rotary._C.cpp";
    TORCH_CHECK_TYPE(false, who, ": cache must be a rotary.KVCache, got ",
                     py::str(type.attr("__qualname__")).cast<std::string>(),
                     raw ? " (the bare C++ module, cache.cpp_module; pass the rotary.KVCache itself)"
                         : "");
  }
  return cache.attr("cpp_module").cast<std::shared_ptr<rotary::KVCacheImpl>>();
}

std::optional<int64_t> optional_start_pos(const py::object& start_pos, const char* who) {
  return start_pos.is_none() ? std::nullopt : std::optional<int64_t>(start_pos_arg(start_pos, who));
}

CacheCall cache_call_args(const py::object& q, const py::object& k, const py::object& v, const py::object& cache,
                          const py::object& start_pos, const py::object& layout) {
  const char* who = "RotaryEmbedding.forward_with_cache";
  // The cache's length is read and advanced on the host: a trace would keep
  // this call's length as a constant (and advance the cache while tracing).
  TORCH_CHECK(!traced_here(), who, ": it reads and advances the KVCache's length on the host, which "
              "torch.jit.trace, torch.export and a FakeTensorMode would keep as a constant; run it eagerly or under "
              "torch.compile (one graph break), or trace rotary.apply_rope_with_kv_cache_ over cache tensors you own "
              "(docs/kv_cache.md)");
  return {required_tensor_arg(q, who, "q"), required_tensor_arg(k, who, "k"), required_tensor_arg(v, who, "v"),
          cache_of(cache, who), optional_start_pos(start_pos, who), str_arg(layout, who, "layout")};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> forward_with_cache(
    rotary::RotaryEmbeddingImpl& rope, const py::object& q, const py::object& k, const py::object& v,
    const py::object& cache, const py::object& start_pos, const py::object& layout) {
  CacheCall call = cache_call_args(q, k, v, cache, start_pos, layout);
  rotary::KVCache holder(call.cache);
  return rope.forward_with_cache(call.q, call.k, call.v, holder, call.start_pos, call.layout);
}

}  // namespace python
}  // namespace rotary
