// Views with a math bit (x.conj(), x.conj().imag) reach the kernels as the
// views they are, under one rule per bit. torch's boxed fallbacks are wrong
// for these ops: the Conjugate one would materialise a lazily conjugated
// table (rows past it would then turn by +angle), and the Negative one
// crashes on an op that writes more than one tensor and returns nothing.
#include "checks/checks.h"
#include "op/op_names.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>

namespace rotary {
namespace {

// Negative bit: a tensor's logical values are the negation of its memory.
// Every write is an odd function of what it reads (a rotation, a copy, an
// fp8 rounding that saturates symmetrically), so a written tensor is handled
// through its memory (the view with the bit cleared) as long as what lands
// in it comes from memory of the same sign:
//   - read-only inputs are materialised, with the sign of the tensor they
//     are copied into (v into v_cache) or plain otherwise;
//   - a tensor written with another written tensor's values (k into k_cache)
//     must share its bit, or the call is refused before anything is written.
struct Arg {
  c10::IValue* value = nullptr;
  const c10::Argument* schema = nullptr;
  bool is_neg() const { return value->isTensor() && value->toTensor().is_neg(); }
};

void negative_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  auto find = [&](const char* name) -> Arg {
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].name() == name) return {&(*stack)[first + i], &args[i]};
    }
    return {};
  };
  const std::string& name = op.schema().name();
  const std::string opname = name.substr(name.find("::") + 2);
  const Arg k = find("k"), k_cache = find("k_cache"), v = find("v"), v_cache = find("v_cache");
  if (k_cache.value) {
    TORCH_CHECK_VALUE(
        k.is_neg() == k_cache.is_neg(), opname, ": k", k.is_neg() ? " is" : " is not", " a negative-bit view but k_cache",
        k_cache.is_neg() ? " is" : " is not", " (Tensor.is_neg()); the rotated k is written into both, so they must ",
        "agree: pass tensors without the bit (t.resolve_neg()) or give both the bit");
  }
  // A read-only input replaced by a copy below would pass the op's overlap
  // checks: checked here against every written tensor, memory to memory.
  auto is_written = [&](size_t i) { return args[i].alias_info() && args[i].alias_info()->isWrite(); };
  auto memory = [](const at::Tensor& t) { return t.is_neg() ? at::_neg_view(t) : t; };
  for (size_t r = 0; r < args.size(); ++r) {
    const c10::IValue& read = (*stack)[first + r];
    if (is_written(r) || !read.isTensor()) continue;
    if (!(read.toTensor().is_neg() || (v.value == &read && v_cache.is_neg()))) continue;
    for (size_t w = 0; w < args.size(); ++w) {
      const c10::IValue& out = (*stack)[first + w];
      if (!is_written(w) || !out.isTensor()) continue;
      detail::check_disjoint(opname.c_str(), args[w].name().c_str(), memory(out.toTensor()), args[r].name().c_str(),
                     memory(read.toTensor()));
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& iv = (*stack)[first + i];
    if (!iv.isTensor()) continue;
    const at::Tensor t = iv.toTensor();
    const bool written = is_written(i);
    if (written) {
      if (t.is_neg()) iv = at::_neg_view(t);  // the same memory, bit cleared
    } else if (v.value == &iv && v_cache.is_neg()) {
      iv = t.is_neg() ? at::_neg_view(t) : at::neg(t);  // memory holds -v, as v_cache's will
    } else if (t.is_neg() && t.is_conj()) {
      // resolve_neg would resolve the conjugate bit too, and rows past the
      // table would turn the other way: -memory, conjugated lazily again.
      iv = at::neg(at::_neg_view(t).conj()).conj();
    } else if (t.is_neg()) {
      iv = t.resolve_neg();
    }
  }
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Negative), stack);
}

}  // namespace

// Both bits are registered for every op that takes a table
// (detail::kTableOps). The prologue ones normalize before they rotate: an
// RMSNorm is odd in its input too.
//
// Conjugate: prepare_rope reads a lazily conjugated table as the inverse
// rotation, inside the table and past it (from inv_freq). Every other
// argument is real, so it has no conjugate bit to carry.
TORCH_LIBRARY_IMPL(rotary, Conjugate, m) {
  for (const char* name : detail::kTableOps) m.impl(name, torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(rotary, Negative, m) {
  for (const char* name : detail::kTableOps) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&negative_kernel>());
}

}  // namespace rotary
