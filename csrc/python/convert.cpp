// Python argument conversion for the _C module (see convert.h).
#include "convert.h"

#include <torch/csrc/autograd/python_variable.h>

#include <cmath>
#include <sstream>

namespace rotary {
namespace python {

using rotary::RopeScaling;

std::string repr_of(py::handle v) {
  return py::repr(v).cast<std::string>();
}

namespace {

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

}  // namespace

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
    if (v.is_none() || (key != "rope_type" && key != "type")) continue;
    TORCH_CHECK_VALUE(py::isinstance<py::str>(v), "rope scaling: '", key, "' must be a string, got ", repr_of(v));
    const std::string t = v.cast<std::string>();
    TORCH_CHECK_VALUE(
        !type || *type == t, "rope scaling: '", type_key, "' = '", *type, "' and '", key, "' = '", t,
        "' disagree ('type' is an alias of 'rope_type')");
    type = t;
    type_key = key;
  }
  if (type) s.type(*type);
  // Catch an unknown type here, where the caller still sees their dict.
  const auto rule = rotary::rope_type_from_string(s.type());
  TORCH_CHECK_VALUE(
      rule.has_value(), "rope scaling: unknown rope_type '", s.type(), "'; expected one of ",
      rotary::rope_type_names());
  for (auto item : d) {
    const std::string key = item.first.cast<std::string>();
    const py::handle v = item.second;
    if (v.is_none() || key == "rope_type" || key == "type") continue;
    // Not strict (a model config): fields of other rules are dropped, as
    // transformers ignores them. Strict: RopeScaling validation refuses them.
    if (!strict && !rotary::rule_uses_field(*rule, key)) continue;
    if (key == "factor") {
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
    } else {
      TORCH_CHECK_VALUE(
          key != "rope_theta" && key != "partial_rotary_factor", "rope scaling: '", key,
          "' describes the model, not the frequency rule: pass theta= / dim= to RotaryEmbedding, or build "
          "it with RotaryEmbedding.from_hf_config(config)");
      TORCH_CHECK_VALUE(false, "rope scaling: unknown key '", key, "'; expected ", kKnownKeys);
    }
  }
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
  // A string is shown quoted, anything else (torch.float16, None) as Python prints it.
  if (py::isinstance<py::str>(obj)) return rotary::angle_dtype_from_string(obj.cast<std::string>(), who);
  const std::string name = py::str(obj).cast<std::string>();
  if (name == "torch.float64" || name == "torch.float32") return rotary::angle_dtype_from_string(name, who);
  return rotary::angle_dtype_from_string(repr_of(obj), who, /*quote=*/false);
}

// An int argument from Python (not a bool, not a float), named in the TypeError.
int64_t int_arg(const py::handle& v, const char* who, const char* name) {
  TORCH_CHECK_TYPE(
      py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v), who, ": ", name, " must be an int, got ",
      repr_of(v));
  try {
    return v.cast<int64_t>();
  } catch (const py::cast_error&) {
    TORCH_CHECK_VALUE(false, who, ": ", name, " must fit in int64, got ", repr_of(v));
  }
  return 0;
}

namespace {

std::vector<int64_t> int_list_arg(const py::handle& v, const char* who, const char* name) {
  if (v.is_none()) return {};
  TORCH_CHECK_TYPE(
      (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)), who, ": ", name,
      " must be a list of ints or None, got ", repr_of(v));
  std::vector<int64_t> out;
  for (const auto item : v) {
    const std::string entry = std::string(name) + "[" + std::to_string(out.size()) + "]";
    out.push_back(int_arg(item, who, entry.c_str()));
  }
  return out;
}

std::vector<double> float_list_arg(const py::handle& v, const char* who, const char* name) {
  if (v.is_none()) return {};
  TORCH_CHECK_TYPE(
      (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)), who, ": ", name,
      " must be a list of numbers or None, got ", repr_of(v));
  std::vector<double> out;
  for (const auto item : v) {
    TORCH_CHECK_TYPE(
        (py::isinstance<py::float_>(item) || py::isinstance<py::int_>(item)) && !py::isinstance<py::bool_>(item),
        who, ": ", name, "[", out.size(), "] must be a number, got ", repr_of(item));
    out.push_back(item.cast<double>());
  }
  return out;
}

bool bool_arg(const py::handle& v, const char* who, const char* name) {
  TORCH_CHECK_TYPE(py::isinstance<py::bool_>(v), who, ": ", name, " must be a bool, got ", repr_of(v));
  return v.cast<bool>();
}

}  // namespace

rotary::RotaryEmbeddingOptions& nd_options_from_py(
    rotary::RotaryEmbeddingOptions& options,
    const py::object& rotary_offset,
    const py::object& mrope_section,
    const py::object& mrope_interleaved,
    const py::object& axes_dim,
    const py::object& axes_theta,
    const py::object& axes_shared_spectrum) {
  const char* who = "RotaryEmbedding";
  return options.rotary_offset(int_arg(rotary_offset, who, "rotary_offset"))
      .mrope_section(int_list_arg(mrope_section, who, "mrope_section"))
      .mrope_interleaved(bool_arg(mrope_interleaved, who, "mrope_interleaved"))
      .axes_dim(int_list_arg(axes_dim, who, "axes_dim"))
      .axes_theta(float_list_arg(axes_theta, who, "axes_theta"))
      .axes_shared_spectrum(bool_arg(axes_shared_spectrum, who, "axes_shared_spectrum"));
}

// The module options from Python arguments, each type checked and named.
rotary::RotaryEmbeddingOptions options_from_py(
    const py::object& dim,
    const py::object& max_seq_len,
    const py::object& theta,
    const py::object& interleaved,
    const py::object& scaling,
    const py::object& angle_dtype) {
  const char* who = "RotaryEmbedding";
  TORCH_CHECK_TYPE(
      (py::isinstance<py::float_>(theta) || py::isinstance<py::int_>(theta)) && !py::isinstance<py::bool_>(theta),
      who, ": theta must be a number, got ", repr_of(theta));
  TORCH_CHECK_TYPE(
      py::isinstance<py::bool_>(interleaved), who,
      ": interleaved must be a bool (True: pairs (0, 1), (2, 3), ...; False: pairs (j, j + dim / 2), Hugging "
      "Face's rotate_half), got ",
      repr_of(interleaved));
  return rotary::RotaryEmbeddingOptions(int_arg(dim, who, "dim"))
      .max_seq_len(int_arg(max_seq_len, who, "max_seq_len"))
      .theta(theta.cast<double>())
      .interleaved(interleaved.cast<bool>())
      .scaling(to_scaling(scaling))
      .angle_dtype(angle_dtype_of(angle_dtype, who));
}

// start_pos of a module or op call: an int in [0, 2^60), also for ints past
// int64, and a tensor (e.g. rope(x, torch.tensor(3)), where the tensor lands in
// k's slot) refused by name.
int64_t start_pos_arg(const py::handle& v, const char* who) {
  TORCH_CHECK_TYPE(
      !THPVariable_Check(v.ptr()), who, ": start_pos must be an int, got a tensor (", repr_of(v),
      "); pass int(t), or a tensor as offsets= or position_ids= (a tensor in the second positional slot is "
      "k, which must be [batch, heads, seq, head_dim])");
  TORCH_CHECK_TYPE(
      py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v), who, ": start_pos must be an int, got ",
      repr_of(v));
  // detail::check_start_pos's words, for any Python int (past int64 too).
  const auto big = py::reinterpret_borrow<py::int_>(v);
  TORCH_CHECK_VALUE(!(big < py::int_(0)), who, ": start_pos must be >= 0, got ", repr_of(v));
  TORCH_CHECK_INDEX(big < py::int_(rotary::kMaxStartPos), who, ": start_pos must be < 2^60, got ", repr_of(v));
  return big.cast<int64_t>();
}

std::optional<torch::Tensor> tensor_arg(const py::handle& v, const std::string& who, const char* name) {
  if (v.is_none()) return std::nullopt;
  TORCH_CHECK_TYPE(THPVariable_Check(v.ptr()), who, ": ", name, " must be a tensor or None, got ", repr_of(v));
  return v.cast<torch::Tensor>();
}

// A module call's arguments: rope(x, start_pos=0, *, offsets=None,
// position_ids=None) or rope(q, k, start_pos=0, ...); rope(x, p) with an int
// p means start_pos p. The deprecated `positions` is routed by
// rotary._ops._legacy_positions, the one place that knows its old meaning,
// with a DeprecationWarning. Returns (q, k or None, start_pos, offsets, ids).
std::tuple<torch::Tensor, OptTensor, int64_t, OptTensor, OptTensor> call_args(
    const py::object& q,
    const py::object& k,
    const py::object& start_pos,
    const py::object& offsets,
    const py::object& position_ids,
    const py::object& positions) {
  const char* who = "RotaryEmbedding";
  const auto x = tensor_arg(q, who, "q (or x)");
  TORCH_CHECK_TYPE(x.has_value(), who, ": q (or x) must be a tensor, got None");
  std::optional<torch::Tensor> k_tensor;
  py::handle pos = start_pos;
  if (py::isinstance<py::int_>(k) && !py::isinstance<py::bool_>(k)) {
    pos = k;  // rope(x, start_pos)
  } else if (py::isinstance<py::bool_>(k) || py::isinstance<py::float_>(k)) {
    start_pos_arg(k);  // a scalar meant as start_pos: say what it must be
  } else if (THPVariable_Check(k.ptr()) && k.cast<torch::Tensor>().dim() == 0) {
    start_pos_arg(k);  // a 0-d tensor meant as start_pos: say so
  } else {
    k_tensor = tensor_arg(k, who, "k");
  }
  const int64_t start = start_pos_arg(pos);
  const auto off = tensor_arg(offsets, who, "offsets");
  const auto ids = tensor_arg(position_ids, who, "position_ids");
  const auto legacy = tensor_arg(positions, who, "positions");
  if (!legacy) return {*x, k_tensor, start, off, ids};
  TORCH_CHECK_VALUE(
      !off && !ids, "RotaryEmbedding: positions= is deprecated; pass offsets= or position_ids= alone");
  const auto [s, o, i] = py::module_::import("rotary._ops")
                             .attr("_legacy_positions")(*legacy, start, false, "RotaryEmbedding")
                             .cast<std::tuple<int64_t, OptTensor, OptTensor>>();
  return {*x, k_tensor, s, o, i};
}

// The Python arguments of a RopeTables / RotaryEmbedding state: the options
// and the rule's state, for pickling.
py::tuple options_to_tuple(const rotary::RopeTables& t) {
  const auto& o = t.options();
  return py::make_tuple(
      o.dim(), o.max_seq_len(), o.theta(), o.interleaved(), scaling_to_dict(o.scaling()),
      rotary::angle_dtype_name(o.angle_dtype()), t.state(), o.axes_dim(), o.axes_theta(), o.axes_shared_spectrum(),
      o.rotary_offset(), o.mrope_section(), o.mrope_interleaved());
}

py::object scaling_or_none(const RopeScaling& s) {
  if (s.type() == "default") return py::none();
  return scaling_to_dict(s);
}


}  // namespace python
}  // namespace rotary
