// The _C module; csrc/python/ is the only place that sees Python. The ops
// themselves are registered with the dispatcher by librotary; this adds the table
// builders, RopeScaling (with its dict form, Hugging Face's rope_parameters)
// and, through bind_*.cpp, the modules' shell and the C++ RotaryEmbedding.
#include "convert.h"
#include "checks/checks.h"
#include "op/op_names.h"
#include "checks/checks_positions.h"
#include "checks/kv_checks.h"
#include "params/layouts.h"

#include <rotary/rotary.h>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/python.h>

#include <cmath>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

using namespace rotary::python;  // NOLINT: the conversion helpers
using rotary::RopeScaling;

namespace {

// The rule arguments both table builders take after their own two.
#define ROTARY_RULE_ARGS                                                                               \
  py::arg("theta") = 10000.0, py::arg("scaling") = py::none(), py::arg("seq_len") = 0, py::kw_only(), \
      py::arg("angle_dtype") = "float64"

// RopeScaling and the table builders.
void bind_rules(py::module_& m) {
  py::class_<RopeScaling>(m, "RopeScaling", "A frequency rule and its parameters (see rotary/scaling.h).")
      .def(py::init([](const std::string& type) { return RopeScaling(type); }), py::arg("rope_type") = "default")
      .def_static(
          "from_dict",
          [](const py::dict& d, const py::object& strict) {
            // pybind's bool takes None or 0 as False: a typo'd key then dropped silently.
            return scaling_from_dict(d, bool_arg(strict, "RopeScaling.from_dict", "strict"));
          },
          py::arg("d"), py::arg("strict") = true,
          "From a dict shaped like Hugging Face's rope_parameters ('type' is an alias of 'rope_type'; a "
          "None value counts as absent). strict: unknown keys are an error.")
      .def("to_dict", &scaling_to_dict)
      .def(
          "validate", [](const RopeScaling& s, int64_t rotary_dim) { rotary::validate(s, rotary_dim); },
          py::arg("rotary_dim"))
      .def_property_readonly("rope_type", [](const RopeScaling& s) { return s.type(); })
      .def("__repr__",
           [](const RopeScaling& s) { return "RopeScaling(" + py::repr(scaling_to_dict(s)).cast<std::string>() + ")"; })
      .def(py::pickle(
          [](const RopeScaling& s) { return scaling_to_dict(s); },
          [](const py::dict& d) { return scaling_from_dict(d, /*strict=*/true); }));

  m.def(
      "rope_freqs",
      [](int64_t dim, int64_t max_seq_len, double theta, const py::object& scaling, int64_t seq_len,
         const py::object& angle_dtype, const std::string& who) {
        rotary::check_table_args(who.c_str(), "dim", dim, theta, seq_len, max_seq_len);  // the caller's words
        return rotary::rope_freqs(
            dim, max_seq_len, theta, to_scaling(scaling, who.c_str()), seq_len, angle_dtype_of(angle_dtype, who.c_str()));
      },
      py::arg("dim"), py::arg("max_seq_len"), ROTARY_RULE_ARGS, py::arg("who") = "rope_freqs",
      "complex64 [max_seq_len, dim // 2] table, entry attention_scaling * exp(i * pos * inv_freq), angles "
      "computed in float64 (angle_dtype='float32': in float32, as Hugging Face / Meta do).");

  m.def(
      "rope_freqs_at",
      [](int64_t dim, const torch::Tensor& positions, double theta, const py::object& scaling, int64_t seq_len,
         const py::object& angle_dtype) {
        TORCH_CHECK_VALUE(dim > 0 && dim % 2 == 0, "rope_freqs_at: dim must be even and > 0, got ", dim);
        const auto f = rotary::compute_frequencies(dim, theta, to_scaling(scaling, "rope_freqs_at"), seq_len);
        return rotary::freqs_at(f, positions, angle_dtype_of(angle_dtype, "rope_freqs_at"));
      },
      py::arg("dim"), py::arg("positions"), ROTARY_RULE_ARGS,
      "The rows of rope_freqs(dim, n, ...) at the given int64 positions (1-D, >= 0), bit for bit, without "
      "building the rows in between: complex64 [len(positions), dim // 2].");

  m.def(
      "rope_frequencies",
      [](int64_t rotary_dim, double theta, const py::object& scaling, int64_t seq_len, const std::string& who) {
        rotary::check_table_args(who.c_str(), "dim", rotary_dim, theta, seq_len);  // the caller's words
        const auto f = rotary::compute_frequencies(rotary_dim, theta, to_scaling(scaling, who.c_str()), seq_len);
        return std::make_tuple(rotary::inv_freq_tensor(f), f.attention_scaling);
      },
      py::arg("rotary_dim"), py::arg("theta") = 10000.0, py::arg("scaling") = py::none(), py::arg("seq_len") = 0,
      py::arg("who") = "rope_frequencies",
      "(inv_freq float64 [rotary_dim // 2], attention_scaling) of a frequency rule.");
}

// The pair -> axis maps of N-D positions, and the older schemes.
void bind_schemes(py::module_& m) {
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
  m.def("legacy_positions_are_ids", &rotary::detail::legacy_positions_are_ids, py::arg("dim"), py::arg("varlen"),
        "Whether a deprecated positions= tensor of this rank held ids (else offsets).");
  m.attr("LEGACY_POSITIONS_WARNING") = rotary::detail::kLegacyPositionsWarning;
  // Typed as the table builders: rotary._ops checks and names the arguments.
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
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "rotary: C++ RotaryEmbedding, frequency rules and tables (ops live in torch.ops.rotary)";
  // The positions bound (rotary/bounds.h), for the Python fast paths.
  m.attr("MAX_POSITION") = rotary::kMaxPosition;
  // The seq dim of each 4-D layout (params/layouts.h), for the module's fast path.
  py::dict seq_axis;
  for (const char* name : {"BHSD", "BSHD", "SBHD"}) seq_axis[name] = rotary::axes_of(rotary::parse_layout(name)).seq;
  m.attr("SEQ_AXIS") = seq_axis;
  // The in-place ops' aliasing rule (checks.h), for the vmap rules: the calls
  // per slice each see one slice, so the rule checks the whole batch first.
  m.def(
      "check_distinct",
      [](const std::string& op, const std::string& name, const torch::Tensor& x) {
        rotary::detail::check_distinct(op.c_str(), name.c_str(), x);
      },
      py::arg("op"), py::arg("name"), py::arg("x"));
  // The layout refusal (checks.h) and the ops layouts.cpp registers it for:
  // a jagged nested tensor's own dispatch runs before those keys (_nested.py).
  m.def("refuse_not_dense", &rotary::detail::refuse_not_dense, py::arg("op"), py::arg("args"));
  const auto& table_ops = rotary::detail::kTableOps;
  m.attr("TABLE_OPS") = std::vector<std::string>(std::begin(table_ops), std::end(table_ops));
  m.def(
      "check_disjoint",
      [](const std::string& op, const std::string& written, const torch::Tensor& w, const std::string& other,
         const torch::Tensor& t, const std::string& why) {
        rotary::detail::check_disjoint(op.c_str(), written.c_str(), w, other.c_str(), t, why.c_str());
      },
      py::arg("op"), py::arg("written"), py::arg("w"), py::arg("other"), py::arg("t"), py::arg("why"));
  // The heads axis of q / k (params/layouts.h), for the vmap rules' fold.
  m.def(
      "heads_axis",
      [](const std::string& layout, bool varlen) { return rotary::heads_axis(rotary::parse_layout(layout), varlen); },
      py::arg("layout"), py::arg("varlen"));

  bind_rules(m);
  bind_schemes(m);
  bind_tables(m);
  m.def(
      "check_start_pos",
      [](const py::object& start_pos, const std::string& who) { return start_pos_arg(start_pos, who.c_str()); },
      py::arg("start_pos"), py::arg("who") = "RotaryEmbedding",
      "start_pos as an int64, or who's error for one outside [0, 2^60) or not an int.");
  m.def(
      "_float_arg",
      [](const py::handle& value, const std::string& who, const std::string& name) {
        return float_arg(value, who.c_str(), name);
      },
      py::arg("value"), py::arg("who"), py::arg("name"),
      "An int or a float as a float; who's error naming `name` for another type or an int past a float's range.");
  m.def("_shown", &repr_of, py::arg("value"), py::arg("typed") = false,
        "A wrong value as the errors show it: a long list or an array by its length or shape.");
  m.def("_plain_int", &plain_int, py::arg("value"),
        "A numpy integer or an int subclass as the Python int it holds; else the value.");
  m.def(
      "check_scale_values",
      [](const std::string& op, const std::string& name, const at::Tensor& scale, const std::string& stored) {
        rotary::detail::check_scale_values(op.c_str(), name.c_str(), scale, stored.c_str());
      },
      py::arg("op"), py::arg("name"), py::arg("scale"), py::arg("stored"),
      "The ops' check of a float32 scale's values (finite and > 0; a CPU one is read), in their words: the DTensor "
      "rules check a per-head scale whole before each rank cuts its heads.");

  bind_kv_cache(m);
  bind_launch(m);
  bind_cpp_module(m);
}
