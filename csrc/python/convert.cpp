// Python argument conversion for the _C module (see convert.h).
#include "convert.h"
#include "checks/checks.h"
#include "checks/checks_positions.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/python_symnode.h>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace rotary {
namespace python {

using rotary::RopeScaling;

std::string repr_of(py::handle v, bool typed) {
  // A long list (a tensor's .tolist()) or an array by its length or shape:
  // its repr is megabytes, seconds to build.
  const std::string type = py::str(py::type::handle_of(v).attr("__name__")).cast<std::string>();
  if (!THPVariable_Check(v.ptr()) && py::hasattr(v, "shape")) {  // an array (a numpy scalar's shape is ())
    const py::object shape = v.attr("shape");
    if (py::isinstance<py::tuple>(shape) && py::len(shape) > 0) {
      return type + " of shape " + py::repr(shape).cast<std::string>();
    }
  }
  if ((py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) && py::len(v) > 16) {
    return type + " of length " + std::to_string(py::len(v));
  }
  std::string text = py::repr(v).cast<std::string>();
  if (text.size() > 200) text = text.substr(0, 200) + "...";
  return typed ? type + " " + text : text;
}

// None, a dict or a RopeScaling.
RopeScaling to_scaling(const py::object& obj, const char* who) {
  if (obj.is_none()) return RopeScaling();
  if (py::isinstance<RopeScaling>(obj)) return obj.cast<RopeScaling>();
  TORCH_CHECK_TYPE(
      py::isinstance<py::dict>(obj), who, ": scaling must be None, a dict like Hugging Face's rope_parameters, or a ",
      "rotary._C.RopeScaling; got ", repr_of(obj));
  return scaling_from_dict(obj.cast<py::dict>(), /*strict=*/true);
}

// angle_dtype from Python: "float64" / "float32" or torch.float64 / torch.float32.
at::ScalarType angle_dtype_of(const py::object& obj, const char* who) {
  // A string is shown quoted, a torch dtype (torch.float16) as Python prints it; anything else is a TypeError.
  if (py::isinstance<py::str>(obj)) return rotary::angle_dtype_from_string(obj.cast<std::string>(), who);
  TORCH_CHECK_TYPE(py::isinstance(obj, py::module_::import("torch").attr("dtype")), who,
                   ": angle_dtype must be 'float64' or 'float32' (a str or a torch dtype), got ", repr_of(obj));
  return rotary::angle_dtype_from_string(py::str(obj).cast<std::string>(), who, /*quote=*/false);
}

// numbers.Real: Python's and numpy's ints and floats (torch's own parser takes
// numpy's), never a complex (its __float__ drops the imaginary part) or a tensor.
static bool is_real_number(const py::handle& v) {
  // Leaked on purpose: a static py::object would be released after the interpreter.
  static PyObject* real = py::object(py::module_::import("numbers").attr("Real")).release().ptr();
  const int is = PyObject_IsInstance(v.ptr(), real);
  if (is < 0) PyErr_Clear();
  return is == 1 && !py::isinstance<py::bool_>(v);
}

// An int argument from Python (any integer type, not a bool or a float),
// named in the TypeError.
int64_t int_arg(const py::handle& given, const char* who, const char* name) {
  const py::object v = plain_int(py::reinterpret_borrow<py::object>(given));
  TORCH_CHECK_TYPE(
      py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v), who, ": ", name, " must be an int, got ",
      repr_of(given));
  try {
    return v.cast<int64_t>();
  } catch (const py::cast_error&) {
    TORCH_CHECK_VALUE(false, who, ": ", name, " must fit in int64, got ", repr_of(v));
  }
  return 0;
}

at::ScalarType dtype_arg(const py::handle& v, const char* who, const char* name) {
  TORCH_CHECK_TYPE(THPDtype_Check(v.ptr()), who, ": ", name, " must be a torch.dtype, got ", repr_of(v));
  return reinterpret_cast<THPDtype*>(v.ptr())->scalar_type;
}

std::string str_arg(const py::handle& v, const char* who, const char* name) {
  TORCH_CHECK_TYPE(py::isinstance<py::str>(v), who, ": ", name, " must be a str, got ", repr_of(v));
  return v.cast<std::string>();
}

// A numbers.Real as a double; an int past a double's range is named
// (pybind's cast names neither it nor the call).
static double real_as_double(const py::handle& v, const char* who, const std::string& name) {
  const double d = PyFloat_AsDouble(v.ptr());
  if (d == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    TORCH_CHECK_VALUE(!py::isinstance<py::int_>(v), who, ": ", name, " must be finite, got an int of ",
                      py::cast<int64_t>(v.attr("bit_length")()), " bits, past a float's range");
    TORCH_CHECK_VALUE(false, who, ": ", name, " must be finite, got a ", Py_TYPE(v.ptr())->tp_name,
                      " past a float's range");  // not its repr: such a number's digits run to hundreds
  }
  return d;
}

double float_arg(const py::handle& v, const char* who, const std::string& name) {
  TORCH_CHECK_TYPE(is_real_number(v), who, ": ", name, " must be a number, got ", repr_of(v));
  return real_as_double(v, who, name);
}

std::optional<double> number_of(const py::handle& v, const char* who, const std::string& name) {
  if (is_real_number(v)) return real_as_double(v, who, name);
  if (!THPVariable_Check(v.ptr())) return std::nullopt;
  const auto type = THPVariable_Unpack(v.ptr()).scalar_type();  // a bool tensor's __float__ reads True as 1.0
  if (!at::isFloatingType(type) && !at::isIntegralType(type, /*includeBool=*/false)) return std::nullopt;
  try {
    return v.cast<double>();  // a one-element tensor
  } catch (const py::cast_error&) {
    return std::nullopt;
  }
}

namespace {

std::vector<int64_t> int_list_arg(const py::handle& v, const char* who, const char* name) {
  return list_arg<int64_t>(v, who, name, "ints", "not set", [&](const py::handle& item, const std::string& entry) {
    return int_arg(item, who, entry.c_str());
  });
}

std::vector<double> float_list_arg(const py::handle& v, const char* who, const char* name) {
  return list_arg<double>(v, who, name, "numbers", "not set", [&](const py::handle& item, const std::string& entry) {
    return float_arg(item, who, entry);
  });
}

}  // namespace

bool bool_arg(const py::handle& v, const char* who, const char* name) {
  TORCH_CHECK_TYPE(py::isinstance<py::bool_>(v), who, ": ", name, " must be a bool, got ", repr_of(v));
  return v.cast<bool>();
}

rotary::RotaryEmbeddingOptions& nd_options_from_py(
    rotary::RotaryEmbeddingOptions& options,
    const py::object& rotary_offset,
    const py::object& mrope_section,
    const py::object& mrope_interleaved,
    const py::object& axes_dim,
    const py::object& axes_theta,
    const py::object& axes_shared_spectrum,
    const py::object& pair_axes) {
  const char* who = "RotaryEmbedding";
  return options.rotary_offset(int_arg(rotary_offset, who, "rotary_offset"))
      .mrope_section(int_list_arg(mrope_section, who, "mrope_section"))
      .mrope_interleaved(bool_arg(mrope_interleaved, who, "mrope_interleaved"))
      .axes_dim(int_list_arg(axes_dim, who, "axes_dim"))
      .axes_theta(float_list_arg(axes_theta, who, "axes_theta"))
      .axes_shared_spectrum(bool_arg(axes_shared_spectrum, who, "axes_shared_spectrum"))
      .pair_axes(int_list_arg(pair_axes, who, "pair_axes"));
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
  const double theta_value = float_arg(theta, who, "theta");
  TORCH_CHECK_TYPE(
      py::isinstance<py::bool_>(interleaved), who,
      ": interleaved must be a bool (True: pairs (0, 1), (2, 3), ...; False: pairs (j, j + dim / 2), Hugging "
      "Face's rotate_half), got ",
      repr_of(interleaved));
  return rotary::RotaryEmbeddingOptions(int_arg(dim, who, "dim"))
      .max_seq_len(int_arg(max_seq_len, who, "max_seq_len"))
      .theta(theta_value)
      .interleaved(interleaved.cast<bool>())
      .scaling(to_scaling(scaling, who))
      .angle_dtype(angle_dtype_of(angle_dtype, who));
}

// start_pos of a module or op call: an int in [0, 2^60), also for ints past
// int64, and a tensor (e.g. rope(x, torch.tensor(3)), where the tensor lands in
// k's slot) refused by name.
int64_t start_pos_arg(const py::handle& given, const char* who) {
  const py::object v = plain_int(py::reinterpret_borrow<py::object>(given));  // numpy's ints too
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

// Refused by name before any size is read: a jagged nested tensor answers
// sizes() from Python with words about aten.size.
static torch::Tensor dense(const py::handle& v, const std::string& who, const char* name) {
  torch::Tensor t = v.cast<torch::Tensor>();
  rotary::detail::check_dense(who.c_str(), name, t);
  return t;
}

std::optional<torch::Tensor> tensor_arg(const py::handle& v, const std::string& who, const char* name) {
  if (v.is_none()) return std::nullopt;
  TORCH_CHECK_TYPE(THPVariable_Check(v.ptr()), who, ": ", name, " must be a tensor or None, got ", repr_of(v));
  return dense(v, who, name);
}

torch::Tensor required_tensor_arg(const py::handle& v, const std::string& who, const char* name) {
  TORCH_CHECK_TYPE(THPVariable_Check(v.ptr()), who, ": ", name, " must be a tensor, got ", repr_of(v));
  return dense(v, who, name);
}

// numpy's integers and int subclasses (an IntEnum: anything with __index__
// but a bool, a tensor or a SymInt) as the Python int they hold, as torch's
// parser takes them; anything else as it is. Python's argument checks
// (_arg_checks.py) call it too.
py::object plain_int(const py::object& v) {
  if (PyLong_CheckExact(v.ptr()) || py::isinstance<py::bool_>(v) || THPVariable_Check(v.ptr()) ||
      torch::is_symint(v) || !PyIndex_Check(v.ptr())) {
    return v;
  }
  PyObject* i = PyNumber_Index(v.ptr());
  if (i == nullptr) {  // numpy's bool has an __index__ that refuses
    PyErr_Clear();
    return v;
  }
  return py::reinterpret_steal<py::object>(i);
}

// A module call's arguments: rope(x, start_pos=0, *, offsets=None,
// position_ids=None) or rope(q, k, start_pos=0, ...); rope(x, p) with an int
// p means start_pos p. The deprecated `positions` is routed by its old
// meaning (detail::legacy_positions_are_ids), with a DeprecationWarning. Returns (q, k or None, start_pos, offsets, ids).
std::tuple<torch::Tensor, OptTensor, int64_t, OptTensor, OptTensor> call_args(
    const py::object& q,
    const py::object& k_given,
    const py::object& start_pos_given,
    const py::object& offsets,
    const py::object& position_ids,
    const py::object& positions) {
  const char* who = "RotaryEmbedding";
  const py::object k = plain_int(k_given), start_pos = plain_int(start_pos_given);
  const torch::Tensor x = required_tensor_arg(q, who, "q (or x)");
  std::optional<torch::Tensor> k_tensor;
  py::handle pos = start_pos;
  if (py::isinstance<py::int_>(k) && !py::isinstance<py::bool_>(k)) {
    // rope(x, start_pos); a start_pos= beside it would be dropped silently.
    const bool default_start = py::isinstance<py::int_>(start_pos) && !py::isinstance<py::bool_>(start_pos) &&
        py::reinterpret_borrow<py::int_>(start_pos).equal(py::int_(0));
    TORCH_CHECK_VALUE(
        default_start, who, ": start_pos is given twice: ", repr_of(k), " in k's place (an int there is start_pos) and ",
        "start_pos=", repr_of(start_pos), "; pass one of them");
    pos = k;
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
  if (!legacy) return {x, k_tensor, start, off, ids};
  TORCH_CHECK_VALUE(
      !off && !ids, "RotaryEmbedding: positions= is deprecated; pass offsets= or position_ids= alone");
  const std::string warning = std::string(who) + ": " + rotary::detail::kLegacyPositionsWarning;
  if (PyErr_WarnEx(PyExc_DeprecationWarning, warning.c_str(), 2) < 0) throw py::error_already_set();
  if (!rotary::detail::legacy_positions_are_ids(legacy->dim(), /*varlen=*/false)) {
    return {x, k_tensor, start, legacy, std::nullopt};
  }
  return {x, k_tensor, 0, std::nullopt, rotary::detail::legacy_ids(who, *legacy, start)};
}

// The Python arguments of a RopeTables / RotaryEmbedding state: the options
// and the rule's state, for pickling.
py::tuple options_to_tuple(const rotary::RopeTables& t) {
  const auto& o = t.options();
  return py::make_tuple(
      o.dim(), o.max_seq_len(), o.theta(), o.interleaved(), scaling_to_dict(o.scaling()),
      rotary::angle_dtype_name(o.angle_dtype()), t.state(), o.axes_dim(), o.axes_theta(), o.axes_shared_spectrum(),
      o.rotary_offset(), o.mrope_section(), o.mrope_interleaved(), o.pair_axes());
}

py::object scaling_or_none(const RopeScaling& s) {
  if (s.type() == "default") return py::none();
  return scaling_to_dict(s);
}

void leaf_unexpected_keys(const py::dict& state_dict, const std::string& prefix, c10::ArrayRef<const char*> own,
                          py::list unexpected_keys) {
  for (auto item : state_dict) {
    const std::string key = py::str(item.first);
    if (key.rfind(prefix, 0) != 0) continue;
    const std::string rest = key.substr(prefix.size());
    if (std::find_if(own.begin(), own.end(), [&](const char* n) { return rest == n; }) == own.end()) {
      unexpected_keys.append(item.first);
    }
  }
}

std::optional<torch::Tensor> saved_tensor(const py::handle& v, const char* who, const char* name, py::list error_msgs) {
  if (THPVariable_Check(v.ptr())) return v.cast<torch::Tensor>();
  error_msgs.append(std::string(who) + ": the saved '" + name + "' must be a tensor, got " + repr_of(v));
  return std::nullopt;
}

}  // namespace python
}  // namespace rotary
