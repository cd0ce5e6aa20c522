// The only translation unit that sees Python. The ops themselves are
// registered with the dispatcher by librotary; this module adds the table
// builders, RopeScaling (with its dict form, Hugging Face's rope_parameters)
// and the C++ RotaryEmbedding.
#include <rotary/rotary.h>

#include <torch/python.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

using rotary::RopeScaling;

std::string repr_of(py::handle v) {
  return py::repr(v).cast<std::string>();
}

double as_double(const std::string& key, py::handle v) {
  TORCH_CHECK_VALUE(
      !py::isinstance<py::bool_>(v) && !py::isinstance<py::str>(v), "rope scaling: '", key,
      "' must be a number, got ", repr_of(v));
  try {
    return v.cast<double>();
  } catch (const py::cast_error&) {
    TORCH_CHECK_VALUE(false, "rope scaling: '", key, "' must be a number, got ", repr_of(v));
  }
  return 0.0;
}

int64_t as_int(const std::string& key, py::handle v) {
  const double d = as_double(key, v);
  TORCH_CHECK_VALUE(
      std::isfinite(d) && d == std::floor(d) && std::abs(d) < 9.0e15, "rope scaling: '", key,
      "' must be an integer, got ", repr_of(v));
  return static_cast<int64_t>(d);
}

bool as_bool(const std::string& key, py::handle v) {
  TORCH_CHECK_VALUE(
      py::isinstance<py::bool_>(v) || py::isinstance<py::int_>(v), "rope scaling: '", key,
      "' must be a bool, got ", repr_of(v));
  return v.cast<bool>();
}

std::vector<double> as_list(const std::string& key, py::handle v) {
  TORCH_CHECK_VALUE(
      py::isinstance<py::sequence>(v) && !py::isinstance<py::str>(v), "rope scaling: '", key,
      "' must be a list of numbers, got ", repr_of(v));
  std::vector<double> out;
  for (auto item : v.cast<py::sequence>()) out.push_back(as_double(key, item));
  return out;
}

constexpr const char* kKnownKeys =
    "rope_type (or type), factor, original_max_position_embeddings, max_position_embeddings, beta_fast, "
    "beta_slow, mscale, mscale_all_dim, attention_factor, truncate, low_freq_factor, high_freq_factor, "
    "short_factor, long_factor";

// A RopeScaling from a dict shaped like Hugging Face's rope_parameters.
// A key set to None counts as absent. strict: an unknown key is an error
// (a typo would otherwise be silently ignored); from_hf_config passes
// strict=False because configs carry model keys such as rope_theta.
RopeScaling scaling_from_dict(const py::dict& d, bool strict) {
  RopeScaling s;
  std::optional<std::string> type;
  std::string type_key;
  for (auto item : d) {
    TORCH_CHECK_VALUE(
        py::isinstance<py::str>(item.first), "rope scaling: keys must be strings, got ", repr_of(item.first));
    const std::string key = item.first.cast<std::string>();
    const py::handle v = item.second;
    if (v.is_none()) continue;
    if (key == "rope_type" || key == "type") {
      TORCH_CHECK_VALUE(
          py::isinstance<py::str>(v), "rope scaling: '", key, "' must be a string, got ", repr_of(v));
      const std::string t = v.cast<std::string>();
      TORCH_CHECK_VALUE(
          !type || *type == t, "rope scaling: '", type_key, "' = '", *type, "' and '", key, "' = '", t,
          "' disagree ('type' is an alias of 'rope_type')");
      type = t;
      type_key = key;
    } else if (key == "factor") {
      s.factor(as_double(key, v));
    } else if (key == "original_max_position_embeddings") {
      s.original_max_position_embeddings(as_int(key, v));
    } else if (key == "max_position_embeddings") {
      s.max_position_embeddings(as_int(key, v));
    } else if (key == "beta_fast") {
      s.beta_fast(as_double(key, v));
    } else if (key == "beta_slow") {
      s.beta_slow(as_double(key, v));
    } else if (key == "mscale") {
      s.mscale(as_double(key, v));
    } else if (key == "mscale_all_dim") {
      s.mscale_all_dim(as_double(key, v));
    } else if (key == "attention_factor") {
      s.attention_factor(as_double(key, v));
    } else if (key == "truncate") {
      s.truncate(as_bool(key, v));
    } else if (key == "low_freq_factor") {
      s.low_freq_factor(as_double(key, v));
    } else if (key == "high_freq_factor") {
      s.high_freq_factor(as_double(key, v));
    } else if (key == "short_factor") {
      s.short_factor(as_list(key, v));
    } else if (key == "long_factor") {
      s.long_factor(as_list(key, v));
    } else if (strict) {
      TORCH_CHECK_VALUE(
          key != "rope_theta" && key != "partial_rotary_factor", "rope scaling: '", key,
          "' describes the model, not the frequency rule: pass theta= / dim= to RotaryEmbedding, or build "
          "it with RotaryEmbedding.from_hf_config(config)");
      TORCH_CHECK_VALUE(false, "rope scaling: unknown key '", key, "'; expected ", kKnownKeys);
    }
  }
  if (type) s.type(*type);
  // Catch an unknown type here, where the caller still sees their dict.
  TORCH_CHECK_VALUE(
      s.type() == "default" || s.type() == "linear" || s.type() == "ntk" || s.type() == "dynamic" ||
          s.type() == "yarn" || s.type() == "llama3" || s.type() == "longrope",
      "rope scaling: unknown rope_type '", s.type(),
      "'; expected one of default, linear, ntk, dynamic, yarn, llama3, longrope");
  return s;
}

// The dict form back: rope_type, every optional field that is set, and the
// other fields where they differ from their defaults.
py::dict scaling_to_dict(const RopeScaling& s) {
  const RopeScaling defaults;
  py::dict d;
  d["rope_type"] = s.type();
  if (s.factor()) d["factor"] = *s.factor();
  if (s.original_max_position_embeddings()) {
    d["original_max_position_embeddings"] = *s.original_max_position_embeddings();
  }
  if (s.max_position_embeddings()) d["max_position_embeddings"] = *s.max_position_embeddings();
  if (s.beta_fast() != defaults.beta_fast()) d["beta_fast"] = s.beta_fast();
  if (s.beta_slow() != defaults.beta_slow()) d["beta_slow"] = s.beta_slow();
  if (s.mscale()) d["mscale"] = *s.mscale();
  if (s.mscale_all_dim()) d["mscale_all_dim"] = *s.mscale_all_dim();
  if (s.attention_factor()) d["attention_factor"] = *s.attention_factor();
  if (s.truncate() != defaults.truncate()) d["truncate"] = s.truncate();
  if (s.low_freq_factor() != defaults.low_freq_factor()) d["low_freq_factor"] = s.low_freq_factor();
  if (s.high_freq_factor() != defaults.high_freq_factor()) d["high_freq_factor"] = s.high_freq_factor();
  if (!s.short_factor().empty()) d["short_factor"] = s.short_factor();
  if (!s.long_factor().empty()) d["long_factor"] = s.long_factor();
  return d;
}

// None, a dict or a RopeScaling.
RopeScaling to_scaling(const py::object& obj) {
  if (obj.is_none()) return RopeScaling();
  if (py::isinstance<RopeScaling>(obj)) return obj.cast<RopeScaling>();
  TORCH_CHECK_TYPE(
      py::isinstance<py::dict>(obj), "scaling must be None, a dict like Hugging Face's rope_parameters, or a ",
      "rotary._C.RopeScaling; got ", repr_of(obj));
  return scaling_from_dict(obj.cast<py::dict>(), /*strict=*/true);
}

// angle_dtype from Python: "float64" / "float32" or torch.float64 / torch.float32.
at::ScalarType angle_dtype_of(const py::object& obj, const char* who) {
  return rotary::angle_dtype_from_string(py::str(obj).cast<std::string>(), who);
}

std::optional<torch::Tensor> pick_positions(
    const std::optional<torch::Tensor>& positions,
    const std::optional<torch::Tensor>& position_ids) {
  TORCH_CHECK_VALUE(
      !(positions && position_ids), "RotaryEmbedding: pass positions or position_ids (an alias), not both");
  return positions ? positions : position_ids;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "rotary: C++ RotaryEmbedding, frequency rules and tables (ops live in torch.ops.rotary)";

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
      "check_saved_tables",
      [](int64_t dim, int64_t max_seq_len, double theta, const py::object& scaling, const py::object& angle_dtype,
         const std::optional<torch::Tensor>& freqs, const std::optional<torch::Tensor>& inv_freq,
         const std::string& who) {
        const auto options = rotary::RotaryEmbeddingOptions(dim)
                                 .max_seq_len(max_seq_len)
                                 .theta(theta)
                                 .scaling(to_scaling(scaling))
                                 .angle_dtype(angle_dtype_of(angle_dtype, who.c_str()));
        return rotary::check_saved_tables(options, freqs, inv_freq, who);
      },
      py::arg("dim"), py::arg("max_seq_len"), py::arg("theta"), py::arg("scaling"), py::arg("angle_dtype"),
      py::arg("freqs"), py::arg("inv_freq"), py::arg("who") = "RotaryEmbedding.load_state_dict",
      "Checks saved (freqs, inv_freq) against these module options (rotary::check_saved_tables); returns the "
      "seq_len of the rule state they match, raises ValueError otherwise.");

  // The older schemes of the seeds (rotary/schemes.h), for comparison.
  m.def("sinusoidal_table", &rotary::sinusoidal_table, py::arg("n"), py::arg("d"), py::arg("base") = 10000.0,
        "float32 [n, d] additive table: pe[pos, 2i] = sin(pos / base^(2i/d)), pe[pos, 2i+1] = cos(...), in float64.");
  m.def("alibi_slopes", &rotary::alibi_slopes, py::arg("n_heads"),
        "float32 [n_heads] ALiBi slopes 2^(-8 (h + 1) / n_heads).");
  m.def("alibi_bias", &rotary::alibi_bias, py::arg("n_heads"), py::arg("seq_len"), py::arg("causal") = true,
        "float32 [n_heads, seq_len, seq_len] ALiBi bias -slope[h] * |i - j| (-inf where j > i when causal).");

  m.def(
      "rope_frequencies",
      [](int64_t rotary_dim, double theta, const py::object& scaling, int64_t seq_len) {
        const auto f = rotary::compute_frequencies(rotary_dim, theta, to_scaling(scaling), seq_len);
        return std::make_tuple(rotary::inv_freq_tensor(f), f.attention_scaling);
      },
      py::arg("rotary_dim"), py::arg("theta") = 10000.0, py::arg("scaling") = py::none(), py::arg("seq_len") = 0,
      "(inv_freq float64 [rotary_dim // 2], attention_scaling) of a frequency rule.");

  m.def(
      "rope_tables",
      [](int64_t rotary_dim, double theta, const py::object& scaling, int64_t seq_len, int64_t rows,
         const py::object& angle_dtype) {
        const auto f = rotary::compute_frequencies(rotary_dim, theta, to_scaling(scaling), seq_len);
        return std::make_tuple(
            rotary::freqs_table(f, rows, angle_dtype_of(angle_dtype, "RotaryEmbedding")), rotary::inv_freq_tensor(f),
            f.attention_scaling);
      },
      py::arg("rotary_dim"), py::arg("theta"), py::arg("scaling"), py::arg("seq_len"), py::arg("rows"),
      py::arg("angle_dtype") = "float64",
      "(freqs complex64 [rows, rotary_dim // 2], inv_freq float64 [rotary_dim // 2], attention_scaling): what "
      "RotaryEmbedding registers.");

  m.def(
      "depends_on_seq_len", [](const py::object& scaling) { return rotary::depends_on_seq_len(to_scaling(scaling)); },
      py::arg("scaling"));

  using Impl = rotary::RotaryEmbeddingImpl;
  using OptTensor = std::optional<torch::Tensor>;
  // force_enable: bind forward ourselves (it is overloaded).
  torch::python::bind_module<Impl, /*force_enable=*/true>(m, "CppRotaryEmbedding")
      .def(
          py::init([](int64_t dim, int64_t max_seq_len, double theta, bool interleaved, const py::object& scaling,
                      const py::object& angle_dtype) {
            return std::make_shared<Impl>(rotary::RotaryEmbeddingOptions(dim)
                                              .max_seq_len(max_seq_len)
                                              .theta(theta)
                                              .interleaved(interleaved)
                                              .scaling(to_scaling(scaling))
                                              .angle_dtype(angle_dtype_of(angle_dtype, "RotaryEmbedding")));
          }),
          py::arg("dim"), py::arg("max_seq_len") = 4096, py::arg("theta") = 10000.0,
          py::arg("interleaved") = true, py::arg("scaling") = py::none(), py::kw_only(),
          py::arg("angle_dtype") = "float64")
      // position_ids is an alias of positions, as in the Python module.
      .def(
          "forward",
          [](Impl& self, const torch::Tensor& x, int64_t start_pos, const OptTensor& positions,
             const OptTensor& position_ids) {
            return self.forward(x, start_pos, pick_positions(positions, position_ids));
          },
          py::arg("x"), py::arg("start_pos") = 0, py::kw_only(), py::arg("positions") = py::none(),
          py::arg("position_ids") = py::none())
      .def(
          "forward",
          [](Impl& self, const torch::Tensor& q, const torch::Tensor& k, int64_t start_pos,
             const OptTensor& positions, const OptTensor& position_ids) {
            return self.forward(q, k, start_pos, pick_positions(positions, position_ids));
          },
          py::arg("q"), py::arg("k"), py::arg("start_pos") = 0, py::kw_only(), py::arg("positions") = py::none(),
          py::arg("position_ids") = py::none())
      // The buffers (module.freqs, module.inv_freq, state_dict()) are reached
      // through torch.nn.cpp.ModuleWrapper, with the same names as in the
      // Python module.
      .def_property_readonly("dim", [](const Impl& self) { return self.options.dim(); })
      .def_property_readonly("max_seq_len", [](const Impl& self) { return self.options.max_seq_len(); })
      .def_property_readonly("theta", [](const Impl& self) { return self.options.theta(); })
      .def_property_readonly("interleaved", [](const Impl& self) { return self.options.interleaved(); })
      .def_property_readonly(
          "scaling",
          [](const Impl& self) -> py::object {
            if (self.options.scaling().type() == "default") return py::none();
            return scaling_to_dict(self.options.scaling());
          })
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

  // torch.nn.cpp.ModuleWrapper._apply casts every buffer with `fn`, which
  // would bypass the C++ to(dtype) override when a Python parent is cast
  // (parent.half(), parent.to(torch.bfloat16)) and turn the complex64 table
  // and the float64 inv_freq into the model's dtype. Take only the device.
  py::object wrapper = m.attr("CppRotaryEmbedding");
  wrapper.attr("_apply") = py::cpp_function(
      [](py::object self, py::object fn, bool /*recurse*/) {
        auto impl = self.attr("cpp_module").cast<std::shared_ptr<Impl>>();
        const auto probe = fn(torch::empty({0}, torch::TensorOptions().device(impl->freqs.device())))
                               .cast<torch::Tensor>();
        impl->to(probe.device());
        return self;
      },
      py::is_method(wrapper), py::arg("fn"), py::arg("recurse") = true);

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
            saved[i] = sd[key].cast<torch::Tensor>();
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
}
