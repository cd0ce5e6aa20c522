// Sparse, mkldnn, quantized and nested tensors dispatch to their own keys before any
// kernel of ours runs, where torch's answer names a backend, not the
// argument. Each such key gets one boxed kernel for every op that takes a
// table: it finds the first argument that is not dense and refuses it by
// name (detail::check_dense).
#include "checks/checks.h"
#include "op/op_names.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

namespace rotary {
namespace {

void refuse_layout(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  const std::string& full = op.schema().name();
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (v.isTensor()) tensors.emplace_back(args[i].name(), v.toTensor());
  }
  detail::refuse_not_dense(full.substr(full.find("::") + 2), tensors);
}

void register_refusals(torch::Library& m) {
  for (const char* name : detail::kTableOps) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&refuse_layout>());
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, SparseCPU, m) { register_refusals(m); }
TORCH_LIBRARY_IMPL(rotary, SparseCUDA, m) { register_refusals(m); }
TORCH_LIBRARY_IMPL(rotary, SparseCsrCPU, m) { register_refusals(m); }
TORCH_LIBRARY_IMPL(rotary, SparseCsrCUDA, m) { register_refusals(m); }
TORCH_LIBRARY_IMPL(rotary, SparseMeta, m) { register_refusals(m); }
TORCH_LIBRARY_IMPL(rotary, SparseCsrMeta, m) { register_refusals(m); }
TORCH_LIBRARY_IMPL(rotary, MkldnnCPU, m) { register_refusals(m); }
TORCH_LIBRARY_IMPL(rotary, QuantizedCPU, m) { register_refusals(m); }
TORCH_LIBRARY_IMPL(rotary, QuantizedCUDA, m) { register_refusals(m); }
TORCH_LIBRARY_IMPL(rotary, NestedTensorCPU, m) { register_refusals(m); }
TORCH_LIBRARY_IMPL(rotary, NestedTensorCUDA, m) { register_refusals(m); }

}  // namespace rotary
