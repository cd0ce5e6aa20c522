// rotary._C.RopeTables: the state machine and module shell of both
// RotaryEmbedding modules (rotary/tables.h, rotary/front_end.h), bound for
// the Python module.
#include "convert.h"

#include <rotary/rotary.h>

#include <torch/csrc/Dtype.h>
#include <torch/python.h>

#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace rotary {
namespace python {

using rotary::RopeTables;

namespace {

// held() of run / state_of / forward_with_cache: the module's (freqs,
// inv_freq), called under the lock, with the GIL.
std::function<rotary::RopeTables::Held()> held_tables(const py::function& held) {
  return [&held] {
    py::gil_scoped_acquire gil;
    return held().cast<rotary::RopeTables::Held>();
  };
}

// run / restore / pickle: the state machine's transitions under its lock.
void def_state_machine(py::class_<RopeTables>& tables) {
  tables
      // run / restore call back into Python holding the lock: wait for the
      // lock without the GIL, so the thread holding it can take the GIL.
      .def(
          "run",
          [](RopeTables& t, int64_t reach, const torch::Device& device, const py::function& held,
             const py::function& op, bool record) {
            py::gil_scoped_release no_gil;
            return t.run(
                reach, device, held_tables(held),
                [&](const rotary::RopeTableSet* fresh) {
                  py::gil_scoped_acquire gil;
                  return fresh ? op(py::make_tuple(fresh->freqs, fresh->inv_freq)) : op(py::none());
                },
                record);
          },
          py::arg("reach"), py::arg("device"), py::arg("held"), py::arg("op"), py::arg("record") = true,
          "op(None) when the held tables (held(): the module's freqs) are right for a call reaching `reach`, else "
          "op((freqs, inv_freq)) with new ones, which op installs; the new state is recorded only when op "
          "returned, and never with record=False (an export's trace).")
      .def(
          "own",
          [](RopeTables& t, const RopeTables::Held& held) {
            py::gil_scoped_release no_gil;  // the lock's holder may be waiting for the GIL
            t.own(held);
          },
          py::arg("held"), "Notes (freqs, inv_freq), installed by the module outside run and restore, as its own "
          "tables of the current state.")
      .def(
          "state_of",
          [](RopeTables& t, const py::function& held) {
            py::gil_scoped_release no_gil;
            return t.state_of(held_tables(held));
          },
          py::arg("held"), "The state of the held tables (held(): the module's freqs), followed as run() does.")
      .def(
          "restore",
          [](RopeTables& t, const py::object& freqs, const py::object& inv_freq, const std::string& who,
             const torch::Device& device, const py::function& install) {
            const auto f = tensor_arg(freqs, who, "the saved 'freqs'");
            const auto inv = tensor_arg(inv_freq, who, "the saved 'inv_freq'");
            py::gil_scoped_release no_gil;
            t.restore(f, inv, who, device, [&](const rotary::RopeTableSet& fresh) {
              py::gil_scoped_acquire gil;
              install(fresh.freqs, fresh.inv_freq);
            });
          },
          py::arg("freqs"), py::arg("inv_freq"), py::arg("who"), py::arg("device"), py::arg("install"),
          "Checks saved buffers against the options (ValueError naming the mismatch), then install(freqs, "
          "inv_freq) with the tables of the state they match, rebuilt from the options.")
      .def(
          "keep",
          [](RopeTables& t, const torch::Tensor& freqs, const torch::Tensor& inv_freq, const std::string& who,
             const py::function& install) {
            py::gil_scoped_release no_gil;
            t.keep({freqs, inv_freq}, who, [&](const rotary::RopeTableSet& fresh) {
              py::gil_scoped_acquire gil;
              install(fresh.freqs, fresh.inv_freq);
            });
          },
          py::arg("freqs"), py::arg("inv_freq"), py::arg("who"), py::arg("install"),
          "After a refused deletion of a table: install(freqs, inv_freq) with the held tables if they are still "
          "the options', else with the current state's, built afresh.")
      .def(py::pickle(
          [](const RopeTables& t) { return options_to_tuple(t); },
          [](const py::tuple& st) {
            auto options = options_from_py(st[0], st[1], st[2], st[3], st[4], st[5]);
            if (st.size() >= 10) {  // axial options (older pickles have none)
              options.axes_dim(st[7].cast<std::vector<int64_t>>())
                  .axes_theta(st[8].cast<std::vector<double>>())
                  .axes_shared_spectrum(st[9].cast<bool>());
            }
            if (st.size() >= 13) {  // span and M-RoPE options
              options.rotary_offset(st[10].cast<int64_t>())
                  .mrope_section(st[11].cast<std::vector<int64_t>>())
                  .mrope_interleaved(st[12].cast<bool>());
            }
            if (st.size() >= 14) options.pair_axes(st[13].cast<std::vector<int64_t>>());  // an explicit map
            return RopeTables(options, st[6].cast<int64_t>());
          }));
}

// The module shell the Python RotaryEmbedding calls: forward_with_cache,
// its repr fields and the span check.
void def_module_shell(py::class_<RopeTables>& tables) {
  // The Python RotaryEmbedding.forward_with_cache: the C++ module's shell
  // over the Python module's buffers; install(freqs, inv_freq) sets new ones.
  tables.def(
      "forward_with_cache",
      [](rotary::RopeTables& t, const py::object& q, const py::object& k, const py::object& v,
         const py::object& cache, const py::object& start_pos, const py::object& layout, const py::function& held,
         const py::function& install) {
        CacheCall call = cache_call_args(q, k, v, cache, start_pos, layout);
        rotary::ModuleBuffers buffers{held_tables(held), [&](const rotary::RopeTableSet& fresh) {
                                        py::gil_scoped_acquire gil;
                                        install(fresh.freqs, fresh.inv_freq);
                                      },
                                      [](at::ScalarType s) {
                                        py::gil_scoped_acquire gil;
                                        return py::repr(py::handle(reinterpret_cast<PyObject*>(
                                                            torch::getTHPDtype(s)))).cast<std::string>();
                                      }};
        py::gil_scoped_release no_gil;  // a host-driven rule's lock is waited for without it
        return rotary::forward_with_cache(t, buffers, call.q, call.k, call.v, *call.cache, call.start_pos, call.layout);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cache"), py::arg("start_pos"), py::arg("layout"),
      py::arg("held"), py::arg("install"));
  // The Python module's repr fields, in Python's spelling.
  tables.def("extra_repr", [](const rotary::RopeTables& t) {
    const auto& o = t.options();
    const auto repr = [](const py::object& v) { return py::repr(v).cast<std::string>(); };
    std::string s = "dim=" + std::to_string(o.dim()) + ", max_seq_len=" + std::to_string(o.max_seq_len()) +
        ", theta=" + repr(py::float_(o.theta())) + ", interleaved=" + (o.interleaved() ? "True" : "False");
    if (o.scaling().type() != "default") s += ", scaling=" + repr(scaling_or_none(o.scaling()));
    if (o.angle_dtype() != torch::kFloat64) s += ", angle_dtype=" + repr(py::str(rotary::angle_dtype_name(o.angle_dtype())));
    if (o.rotary_offset() != 0) s += ", rotary_offset=" + std::to_string(o.rotary_offset());
    if (!o.mrope_section().empty()) {
      s += ", mrope_section=" + repr(py::cast(o.mrope_section()));
      if (o.mrope_interleaved()) s += ", mrope_interleaved=True";
    }
    if (!o.axes_dim().empty()) s += ", axes_dim=" + repr(py::cast(o.axes_dim()));
    if (!o.axes_theta().empty()) s += ", axes_theta=" + repr(py::cast(o.axes_theta()));
    if (o.axes_shared_spectrum()) s += ", axes_shared_spectrum=True";
    if (!o.pair_axes().empty()) s += ", pair_axes=" + repr(py::cast(o.pair_axes()));
    return s;
  });
  tables.def(
      "check_span",
      [](const rotary::RopeTables& t, const py::object& q) {
        const auto shape = py::repr(py::module_::import("builtins").attr("tuple")(q.attr("shape")));
        rotary::check_span(t.options(), q.cast<torch::Tensor>(), shape.cast<std::string>());
      },
      py::arg("q"), "ValueError unless head_dim of q holds the rotated span (the module's words).");
  tables.def(
      "refuse_axial_call",
      [](const rotary::RopeTables& t, const std::string& given) { rotary::refuse_axial_call(t.options(), given); },
      py::arg("given"), "ValueError: an axial module called without [n_axes, batch, seq] position_ids.");
  tables.def(
      "refuse_nd_positions",
      [](const rotary::RopeTables& t, const std::string& shape) { rotary::refuse_nd_positions(t.options(), shape); },
      py::arg("shape"), "ValueError: [n_axes, batch, seq] position_ids given to a module with no pair -> axis map.");
}

}  // namespace

void bind_tables(py::module_& m) {
  py::class_<RopeTables> tables(
      m, "RopeTables",
      "The state machine of both RotaryEmbedding modules (rotary/tables.h): options, which tables they build, "
      "when the host-driven rules rebuild them, the checks of saved tables, and the lock.");
  def_options_init(tables, [](const rotary::RotaryEmbeddingOptions& o) { return RopeTables(o); });
  def_option_properties(tables, [](const RopeTables& t) -> const rotary::RotaryEmbeddingOptions& {
    return t.options();
  });
  tables
      .def_property_readonly("host_driven", &RopeTables::host_driven)
      .def_property_readonly("pair_axes", [](const RopeTables& t) { return list_or_none(rotary::pair_axes_of(t.options())); })
      .def_property_readonly("extends_past_table", &RopeTables::extends_past_table)
      .def_property_readonly("state", &RopeTables::state)
      .def_property_readonly("attention_scaling", &RopeTables::attention_scaling)
      .def(
          "build",
          [](const RopeTables& t, const std::optional<torch::Device>& device) {
            const auto b = t.build(t.state(), device.value_or(torch::kCPU));
            return std::make_tuple(b.freqs, b.inv_freq);
          },
          py::arg("device") = py::none(), "(freqs, inv_freq) of the current state.")
      .def_static(
          "call_args", &call_args, py::arg("q"), py::arg("k"), py::arg("start_pos"), py::arg("offsets"),
          py::arg("position_ids"), py::arg("positions"),
          "(q, k, start_pos, offsets, position_ids) of a module call, type checked (a deprecated positions "
          "routed); raises the module's errors.")
      .def_static(
          "reach_of", &RopeTables::reach_of, py::arg("seq_len"), py::arg("start_pos"), py::arg("offsets"),
          py::arg("position_ids"))
      .def("check_reach", &RopeTables::check_reach, py::arg("reach"))
      .def("_tracked_tables", &RopeTables::tracked_tables)
      .def("check_rows", &RopeTables::check_rows, py::arg("seq_len"), py::arg("start_pos"), py::arg("has_positions"),
           py::arg("rows"));
  def_state_machine(tables);
  def_module_shell(tables);
}

}  // namespace python
}  // namespace rotary
