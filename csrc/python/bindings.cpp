// The _C module; csrc/python/ is the only place that sees Python. The ops
// themselves are registered with the dispatcher by librotary; this adds the table
// builders, RopeScaling (with its dict form, Hugging Face's rope_parameters)
// and the C++ RotaryEmbedding.
#include "convert.h"
#include "checks/checks_positions.h"

#include <rotary/rotary.h>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/python.h>

#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

using namespace rotary::python;  // NOLINT: the conversion helpers
using rotary::RopeScaling;

PYBIND11_MODULE(_C, m) {
  m.doc() = "rotary: C++ RotaryEmbedding, frequency rules and tables (ops live in torch.ops.rotary)";
  // The positions bound (rotary/bounds.h), for the Python fast paths.
  m.attr("MAX_POSITION") = rotary::kMaxPosition;

  py::class_<RopeScaling>(m, "RopeScaling", "A frequency rule and its parameters (see rotary/scaling.h).")
      .def(py::init([](const std::string& type) { return RopeScaling(type); }), py::arg("rope_type") = "default")
      .def_static(
          "from_dict", &scaling_from_dict, py::arg("d"), py::arg("strict") = true,
          "From a dict shaped like Hugging Face's rope_parameters ('type' is an alias of 'rope_type'; a "
          "None value counts as absent). strict: unknown keys are an error.")
      .def("to_dict", &scaling_to_dict)
      .def(
          "validate", [](const RopeScaling& s, int64_t rotary_dim) { rotary::validate(s, rotary_dim); },
          py::arg("rotary_dim"))
      .def_property_readonly("rope_type", [](const RopeScaling& s) { return s.type(); })
      .def("__repr__", [](const RopeScaling& s) { return "RopeScaling(" + repr_of(scaling_to_dict(s)) + ")"; })
      .def(py::pickle(
          [](const RopeScaling& s) { return scaling_to_dict(s); },
          [](const py::dict& d) { return scaling_from_dict(d, /*strict=*/true); }));

  m.def(
      "rope_freqs",
      [](int64_t dim, int64_t max_seq_len, double theta, const py::object& scaling, int64_t seq_len,
         const py::object& angle_dtype) {
        return rotary::rope_freqs(
            dim, max_seq_len, theta, to_scaling(scaling), seq_len, angle_dtype_of(angle_dtype, "rope_freqs"));
      },
      py::arg("dim"), py::arg("max_seq_len"), py::arg("theta") = 10000.0, py::arg("scaling") = py::none(),
      py::arg("seq_len") = 0, py::kw_only(), py::arg("angle_dtype") = "float64",
      "complex64 [max_seq_len, dim // 2] table, entry attention_scaling * exp(i * pos * inv_freq), angles "
      "computed in float64 (angle_dtype='float32': in float32, as Hugging Face / Meta do).");

  m.def(
      "rope_freqs_at",
      [](int64_t dim, const torch::Tensor& positions, double theta, const py::object& scaling, int64_t seq_len,
         const py::object& angle_dtype) {
        TORCH_CHECK_VALUE(dim > 0 && dim % 2 == 0, "rope_freqs_at: dim must be even and > 0, got ", dim);
        const auto f = rotary::compute_frequencies(dim, theta, to_scaling(scaling), seq_len);
        return rotary::freqs_at(f, positions, angle_dtype_of(angle_dtype, "rope_freqs_at"));
      },
      py::arg("dim"), py::arg("positions"), py::arg("theta") = 10000.0, py::arg("scaling") = py::none(),
      py::arg("seq_len") = 0, py::kw_only(), py::arg("angle_dtype") = "float64",
      "The rows of rope_freqs(dim, n, ...) at the given int64 positions (1-D, >= 0), bit for bit, without "
      "building the rows in between: complex64 [len(positions), dim // 2].");

  m.def(
      "mrope_pair_axes", &rotary::mrope_pair_axes, py::arg("sections"), py::arg("rotary_dim"),
      py::arg("interleaved") = false,
      "The pair -> axis map of multimodal RoPE (rotary/axes.h): contiguous sections (Qwen2-VL) or "
      "interleaved (Qwen3-VL); the pair_axes argument of the ops.");

  m.def(
      "axial_rope",
      [](const std::vector<int64_t>& axes_dim, const std::vector<double>& thetas, bool shared_spectrum) {
        auto r = rotary::axial_rope(axes_dim, thetas, shared_spectrum);
        return std::make_pair(r.pair_axes, r.freqs.inv_freq);
      },
      py::arg("axes_dim"), py::arg("thetas"), py::arg("shared_spectrum") = false,
      "(pair_axes, inv_freq) of axial RoPE (rotary/axes.h): FLUX's per-axis spectra, or Pixtral's shared one.");

  // The older position schemes (rotary/schemes.h), for comparison.
  m.def(
      "legacy_ids",
      [](const std::string& who, const torch::Tensor& ids, int64_t start_pos) {
        return rotary::detail::legacy_ids(who.c_str(), ids, start_pos);
      },
      py::arg("who"), py::arg("ids"), py::arg("start_pos"),
      "start_pos + ids of the deprecated positions= argument, in int64 (checked so the sum cannot wrap).");
  m.def("sinusoidal_table", &rotary::sinusoidal_table, py::arg("n"), py::arg("d"), py::arg("base") = 10000.0,
        "float32 [n, d] additive table: pe[pos, 2i] = sin(pos / base^(2i/d)), pe[pos, 2i+1] = cos(...), in float64.");
  m.def("alibi_slopes", &rotary::alibi_slopes, py::arg("n_heads"),
        "float32 [n_heads] ALiBi slopes 2^(-8 (h + 1) / n_heads).");
  m.def(
      "alibi_bias",
      [](int64_t n_heads, int64_t seq_len, const py::object& causal) {
        TORCH_CHECK_TYPE(py::isinstance<py::bool_>(causal), "alibi_bias: causal must be a bool, got ", repr_of(causal));
        return rotary::alibi_bias(n_heads, seq_len, causal.cast<bool>());
      },
      py::arg("n_heads"), py::arg("seq_len"), py::arg("causal") = true,
        "float32 [n_heads, seq_len, seq_len] ALiBi bias -slope[h] * |i - j| (-inf where j > i when causal).");

  m.def(
      "rope_frequencies",
      [](int64_t rotary_dim, double theta, const py::object& scaling, int64_t seq_len) {
        const auto f = rotary::compute_frequencies(rotary_dim, theta, to_scaling(scaling), seq_len);
        return std::make_tuple(rotary::inv_freq_tensor(f), f.attention_scaling);
      },
      py::arg("rotary_dim"), py::arg("theta") = 10000.0, py::arg("scaling") = py::none(), py::arg("seq_len") = 0,
      "(inv_freq float64 [rotary_dim // 2], attention_scaling) of a frequency rule.");

  bind_tables(m);
  m.def(
      "check_start_pos",
      [](const py::object& start_pos, const std::string& who) { return start_pos_arg(start_pos, who.c_str()); },
      py::arg("start_pos"), py::arg("who") = "RotaryEmbedding",
      "start_pos as an int64, or who's error for one outside [0, 2^60) or not an int.");

  bind_kv_cache(m);
  bind_launch(m);
  using Impl = rotary::RotaryEmbeddingImpl;
  // force_enable: bind forward ourselves (it is overloaded).
  auto cpp_module = torch::python::bind_module<Impl, /*force_enable=*/true>(m, "CppRotaryEmbedding");
  def_options_init(cpp_module, [](const rotary::RotaryEmbeddingOptions& o) { return std::make_shared<Impl>(o); });
  cpp_module
      .def_property_readonly("pair_axes", [](const Impl& self) { return self.pair_axes; })
      // rope(x, start_pos=0) or rope(q, k, start_pos=0); offsets= or
      // position_ids= (positions= deprecated), as in the Python module.
      .def(
          "forward",
          [](Impl& self, const py::object& q, const py::object& k, const py::object& start_pos,
             const py::object& offsets, const py::object& position_ids, const py::object& positions) -> py::object {
            auto [x, k_tensor, pos, off, ids] = call_args(q, k, start_pos, offsets, position_ids, positions);
            if (!k_tensor) return py::cast(self.forward(x, pos, off, ids));
            return py::cast(self.forward(x, *k_tensor, pos, off, ids));
          },
          py::arg("q"), py::arg("k") = py::none(), py::arg("start_pos") = 0, py::kw_only(),
          py::arg("offsets") = py::none(), py::arg("position_ids") = py::none(), py::arg("positions") = py::none())
      .def("forward_with_cache", &forward_with_cache, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cache"),
           py::arg("start_pos") = py::none(),
           "Rotate q and k in place at start_pos (default: cache.length) and append k and v to the KVCache, in one "
           "op; returns (q, keys, values) with the filled cache as [batch, kv_heads, length, head_dim].")
      // The buffers (module.freqs, module.inv_freq, state_dict()) are reached
      // through torch.nn.cpp.ModuleWrapper, with the same names as in the
      // Python module.
      .def_property_readonly("dim", [](const Impl& self) { return self.options.dim(); })
      .def_property_readonly("max_seq_len", [](const Impl& self) { return self.options.max_seq_len(); })
      .def_property_readonly("theta", [](const Impl& self) { return self.options.theta(); })
      .def_property_readonly("interleaved", [](const Impl& self) { return self.options.interleaved(); })
      .def_property_readonly("scaling", [](const Impl& self) { return scaling_or_none(self.tables().options().scaling()); })
      .def_property_readonly("host_driven", &Impl::host_driven)
      .def_property_readonly("_rope_state", [](const Impl& self) { return self.tables().state(); })
      .def_property_readonly("attention_scaling", [](const Impl& self) { return self.attention_scaling; })
      .def_property_readonly(
          "angle_dtype", [](const Impl& self) { return rotary::angle_dtype_name(self.options.angle_dtype()); })
      .def(
          "load_tables",
          [](Impl& self, const std::optional<torch::Tensor>& freqs, const std::optional<torch::Tensor>& inv_freq) {
            self.load_tables(freqs, inv_freq, "CppRotaryEmbedding.load_tables");
          },
          py::arg("freqs"), py::arg("inv_freq") = py::none(),
          "Check saved buffers against the options (ValueError if they differ), then rebuild both from them.");

  // A parent's cast must not turn the complex64 table and the float64
  // inv_freq into the model's dtype.
  py::object wrapper = m.attr("CppRotaryEmbedding");
  apply_moves_only<Impl>(wrapper);

  // ModuleWrapper copies the C++ module's attributes once, at construction;
  // the rule's state changes, so the wrapper reads it on each access.
  wrapper.attr("rope_state") = py::module_::import("builtins").attr("property")(py::cpp_function(
      [](py::object self) { return self.attr("cpp_module").attr("_rope_state"); }, py::is_method(wrapper)));

  // load_state_dict on the wrapper would copy the saved buffers in as they
  // are; check them against the options and rebuild instead (load_tables),
  // as the Python RotaryEmbedding and torch::load do.
  wrapper.attr("_load_from_state_dict") = py::cpp_function(
      [](py::object self, py::object state_dict, const std::string& prefix, py::object /*local_metadata*/,
         bool strict, py::list missing_keys, py::list unexpected_keys, py::list error_msgs) {
        auto impl = self.attr("cpp_module").cast<std::shared_ptr<Impl>>();
        const py::dict sd(state_dict);
        std::optional<torch::Tensor> saved[2];
        const char* names[2] = {"freqs", "inv_freq"};
        for (int i = 0; i < 2; ++i) {
          const py::str key(prefix + names[i]);
          if (sd.contains(key)) {
            py::object v = sd[key];
            if (!THPVariable_Check(v.ptr())) {
              error_msgs.append(
                  "CppRotaryEmbedding.load_state_dict: the saved '" + std::string(names[i]) + "' must be a tensor, got " +
                  repr_of(v));
              return;
            }
            saved[i] = v.cast<torch::Tensor>();
          } else {
            missing_keys.append(key);
          }
        }
        // A mismatch is reported like any load error: load_state_dict raises
        // RuntimeError listing it, and the buffers stay as they were.
        if (saved[0] || saved[1]) {
          try {
            impl->load_tables(saved[0], saved[1], "CppRotaryEmbedding.load_state_dict");
          } catch (const c10::ValueError& e) {
            error_msgs.append(std::string(e.what_without_backtrace()));
          }
        }
        if (strict) {
          for (auto item : sd) {
            const std::string key = py::str(item.first);
            if (key.rfind(prefix, 0) != 0) continue;
            const std::string rest = key.substr(prefix.size());
            if (rest != "freqs" && rest != "inv_freq") unexpected_keys.append(item.first);
          }
        }
      },
      py::is_method(wrapper), py::arg("state_dict"), py::arg("prefix"), py::arg("local_metadata"),
      py::arg("strict"), py::arg("missing_keys"), py::arg("unexpected_keys"), py::arg("error_msgs"));

  repr_from_pretty_print<Impl>(wrapper);
  // pickle / copy.deepcopy: rebuilt from the options and the saved tables
  // (load_tables restores the host-driven state).
  def_pickle<Impl>(
      m, wrapper, "_cpp_rope_from_state",
      [](const Impl& impl) {
        const auto& o = impl.options;
        py::object scaling = o.scaling().type() == "default" ? py::object(py::none()) : py::object(scaling_to_dict(o.scaling()));
        return py::make_tuple(
            o.dim(), o.max_seq_len(), o.theta(), o.interleaved(), scaling, rotary::angle_dtype_name(o.angle_dtype()),
            impl.freqs, impl.inv_freq, impl.is_training(), o.rotary_offset(), o.mrope_section(),
            o.mrope_interleaved(), o.axes_dim(), o.axes_theta(), o.axes_shared_spectrum());
      },
      [wrapper](const py::tuple& st) {
        TORCH_CHECK_VALUE(st.size() == 15, "CppRotaryEmbedding: unexpected pickled state of size ", st.size());
        auto impl = std::make_shared<Impl>(
            rotary::RotaryEmbeddingOptions(st[0].cast<int64_t>())
                .max_seq_len(st[1].cast<int64_t>())
                .theta(st[2].cast<double>())
                .interleaved(st[3].cast<bool>())
                .scaling(to_scaling(st[4]))
                .angle_dtype(angle_dtype_of(st[5], "CppRotaryEmbedding"))
                .rotary_offset(st[9].cast<int64_t>())
                .mrope_section(st[10].cast<std::vector<int64_t>>())
                .mrope_interleaved(st[11].cast<bool>())
                .axes_dim(st[12].cast<std::vector<int64_t>>())
                .axes_theta(st[13].cast<std::vector<double>>())
                .axes_shared_spectrum(st[14].cast<bool>()));
        impl->load_tables(st[6].cast<torch::Tensor>(), st[7].cast<torch::Tensor>(), "CppRotaryEmbedding (unpickle)");
        impl->to(st[6].cast<torch::Tensor>().device());
        py::object obj = wrapper.attr("__new__")(wrapper);
        py::module_::import("torch.nn.cpp").attr("ModuleWrapper").attr("__init__")(obj, py::cast(impl));
        impl->train(st[8].cast<bool>());  // after nn.Module.__init__, which sets training = True
        return obj;
      });
}
