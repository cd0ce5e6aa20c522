// rotary._C.CppRotaryEmbedding: torch::python::bind_module of the C++ module,
// with the Python module's call, state-dict load, repr and pickling.
#include "convert.h"

#include <rotary/rotary.h>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/python.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace rotary {
namespace python {
namespace {

using Impl = rotary::RotaryEmbeddingImpl;

// load_state_dict on the wrapper would copy the saved buffers in as they
// are; check them against the options and rebuild instead (load_tables), as
// the Python RotaryEmbedding and torch::load do.
void load_from_state_dict(
    py::object self, py::object state_dict, const std::string& prefix, py::object /*local_metadata*/, bool strict,
    py::list missing_keys, py::list unexpected_keys, py::list error_msgs) {
  auto impl = self.attr("cpp_module").cast<std::shared_ptr<Impl>>();
  const py::dict sd(state_dict);
  const char* who = "CppRotaryEmbedding.load_state_dict";
  std::optional<torch::Tensor> saved[2];
  const char* names[2] = {"freqs", "inv_freq"};
  // Both left out: the tables follow from the options, and the module keeps its own.
  const bool neither = !sd.contains(py::str(prefix + names[0])) && !sd.contains(py::str(prefix + names[1]));
  for (int i = 0; i < 2 && !neither; ++i) {
    const py::str key(prefix + names[i]);
    if (!sd.contains(key)) {
      missing_keys.append(key);
    } else if (!(saved[i] = saved_tensor(sd[key], who, names[i], error_msgs))) {
      return;
    }
  }
  // A mismatch is reported like any load error: load_state_dict raises
  // RuntimeError listing it, and the buffers stay as they were.
  if (saved[0] || saved[1]) {
    try {
      impl->load_tables(saved[0], saved[1], who);
    } catch (const c10::ValueError& e) {
      error_msgs.append(std::string(e.what_without_backtrace()));
    } catch (const c10::TypeError& e) {  // a sparse, mkldnn or nested table
      error_msgs.append(std::string(e.what_without_backtrace()));
    }
  }
  if (strict) leaf_unexpected_keys(sd, prefix, names, unexpected_keys);
}

// pickle / copy.deepcopy: the options in effect, the tables and their
// state; rebuilt from them (load_tables checks them, the state a hint past
// what inv_freq recovers).
py::tuple cpp_rope_state(const Impl& impl) {
  const auto& o = impl.tables().options();
  py::object scaling = o.scaling().type() == "default" ? py::object(py::none()) : py::object(scaling_to_dict(o.scaling()));
  return py::make_tuple(
      o.dim(), o.max_seq_len(), o.theta(), o.interleaved(), scaling, rotary::angle_dtype_name(o.angle_dtype()),
      impl.freqs, impl.inv_freq, impl.is_training(), o.rotary_offset(), o.mrope_section(),
      o.mrope_interleaved(), o.axes_dim(), o.axes_theta(), o.axes_shared_spectrum(), impl.tables().state(),
      o.pair_axes());
}

py::object cpp_rope_from_state(const py::object& wrapper, const py::tuple& st) {
  TORCH_CHECK_VALUE(st.size() >= 15 && st.size() <= 17, "CppRotaryEmbedding: unexpected pickled state of size ",
                    st.size());
  auto impl = std::make_shared<Impl>(
      rotary::RotaryEmbeddingOptions(st[0].cast<int64_t>())
          .max_seq_len(st[1].cast<int64_t>())
          .theta(st[2].cast<double>())
          .interleaved(st[3].cast<bool>())
          .scaling(to_scaling(st[4], "CppRotaryEmbedding"))
          .angle_dtype(angle_dtype_of(st[5], "CppRotaryEmbedding"))
          .rotary_offset(st[9].cast<int64_t>())
          .mrope_section(st[10].cast<std::vector<int64_t>>())
          .mrope_interleaved(st[11].cast<bool>())
          .axes_dim(st[12].cast<std::vector<int64_t>>())
          .axes_theta(st[13].cast<std::vector<double>>())
          .axes_shared_spectrum(st[14].cast<bool>())
          .pair_axes(st.size() == 17 ? st[16].cast<std::vector<int64_t>>() : std::vector<int64_t>{}));
  const auto state = st.size() >= 16 ? std::optional<int64_t>(st[15].cast<int64_t>()) : std::nullopt;
  impl->load_tables(st[6].cast<torch::Tensor>(), st[7].cast<torch::Tensor>(), "CppRotaryEmbedding (unpickle)", state);
  impl->to(st[6].cast<torch::Tensor>().device());
  py::object obj = wrapper.attr("__new__")(wrapper);
  py::module_::import("torch.nn.cpp").attr("ModuleWrapper").attr("__init__")(obj, py::cast(impl));
  adopt_wrapper(obj);
  impl->train(st[8].cast<bool>());  // after nn.Module.__init__, which sets training = True
  return obj;
}

}  // namespace

void bind_cpp_module(py::module_& m) {
  // force_enable: bind forward ourselves (it is overloaded).
  auto cpp_module = torch::python::bind_module<Impl, /*force_enable=*/true>(m, "CppRotaryEmbedding");
  def_options_init(cpp_module, [](const rotary::RotaryEmbeddingOptions& o) { return std::make_shared<Impl>(o); });
  def_option_properties(
      cpp_module, [](const Impl& self) -> const rotary::RotaryEmbeddingOptions& { return self.tables().options(); });
  cpp_module
      .def_property_readonly("pair_axes", [](const Impl& self) { return list_or_none(self.pair_axes); })
      // rope(x, start_pos=0) or rope(q, k, start_pos=0); offsets= or
      // position_ids= (positions= deprecated) and layout=, as in the Python module.
      .def(
          "forward",
          [](Impl& self, const py::object& q, const py::object& k, const py::object& start_pos,
             const py::object& offsets, const py::object& position_ids, const py::object& positions,
             const py::object& layout_arg) -> py::object {
            const std::string layout = str_arg(layout_arg, "CppRotaryEmbedding", "layout");
            // Host-driven rules size the table by every rank's positions (rotary._dtensor_shards).
            auto whole = [&](const py::object& t, const char* name) -> py::object {
              if (!self.host_driven() || t.is_none() || THPVariable_CheckExact(t.ptr())) return t;
              return py::module_::import("rotary._dtensor_shards").attr("whole_positions")(t, name);
            };
            auto [x, k_tensor, pos, off, ids] = call_args(q, k, start_pos, whole(offsets, "offsets"),
                                                          whole(position_ids, "position_ids"),
                                                          whole(positions, "positions"));
            if (!k_tensor) return py::cast(self.forward(x, pos, off, ids, layout));
            return py::cast(self.forward(x, *k_tensor, pos, off, ids, layout));
          },
          py::arg("q"), py::arg("k") = py::none(), py::arg("start_pos") = 0, py::kw_only(),
          py::arg("offsets") = py::none(), py::arg("position_ids") = py::none(), py::arg("positions") = py::none(),
          py::arg("layout") = "BHSD")
      .def("forward_with_cache", &forward_with_cache, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cache"),
           py::arg("start_pos") = py::none(), py::kw_only(), py::arg("layout") = "BHSD",
           "Rotate q and k in place at start_pos (default: cache.length) and append k and v to the KVCache, in one "
           "op; returns (q, keys, values) with the filled cache as [batch, kv_heads, length, head_dim].")
      // The buffers (module.freqs, module.inv_freq, state_dict()) are reached
      // through torch.nn.cpp.ModuleWrapper, with the same names as in the
      // Python module.
      .def_property_readonly("host_driven", &Impl::host_driven)
      .def_property_readonly("_rope_state", [](const Impl& self) { return self.tables().state(); })
      .def("_tracked_tables", [](const Impl& self) { return self.tables().tracked_tables(); })
      .def_property_readonly("attention_scaling", [](const Impl& self) { return self.attention_scaling; })
      .def(
          "update_for_reach",
          [](Impl& self, const py::object& reach) {
            // The Python module's argument check: numpy's ints and torch.max(ids) + 1 too.
            const py::object index = py::module_::import("rotary._arg_checks").attr("_index_arg");
            self.update_for_reach(index("CppRotaryEmbedding.update_for_reach", "reach", reach).cast<int64_t>());
          },
          py::arg("reach"),
          "Host-driven rules: make the tables right for a call whose largest position is reach - 1 (reach in "
          "[0, 2^60]). Other rules: no-op.")
      .def(
          "load_tables",
          [](Impl& self, const std::optional<torch::Tensor>& freqs, const std::optional<torch::Tensor>& inv_freq) {
            self.load_tables(freqs, inv_freq, "CppRotaryEmbedding.load_tables");
          },
          py::arg("freqs"), py::arg("inv_freq") = py::none(),
          "Check saved buffers against the options (ValueError if they differ), then rebuild both from them.")
      .def("_keep_tables", &Impl::keep_tables,
           "After a refused deletion of a table: the tables held if still the options', else the state's.");

  // A parent's cast must not turn the complex64 table and the float64
  // inv_freq into the model's dtype.
  py::object wrapper = m.attr("CppRotaryEmbedding");
  apply_moves_only<Impl>(wrapper);
  // A Python forward over the bound one: Dynamo and export meet a reason.
  wrapper.attr("forward") = py::module_::import("rotary._cpp_wrappers").attr("cpp_forward");

  // ModuleWrapper copies the C++ module's attributes once, at construction;
  // the rule's state changes, so the wrapper reads it on each access.
  wrapper.attr("rope_state") = py::module_::import("builtins").attr("property")(py::cpp_function(
      [](py::object self) { return self.attr("cpp_module").attr("_rope_state"); }, py::is_method(wrapper)));

  wrapper.attr("_load_from_state_dict") = py::cpp_function(
      &load_from_state_dict, py::is_method(wrapper), py::arg("state_dict"), py::arg("prefix"),
      py::arg("local_metadata"), py::arg("strict"), py::arg("missing_keys"), py::arg("unexpected_keys"),
      py::arg("error_msgs"));

  repr_from_pretty_print<Impl>(wrapper);
  def_pickle<Impl>(
      m, wrapper, "_cpp_rope_from_state", &cpp_rope_state,
      [wrapper](const py::tuple& st) { return cpp_rope_from_state(wrapper, st); });
}

}  // namespace python
}  // namespace rotary
