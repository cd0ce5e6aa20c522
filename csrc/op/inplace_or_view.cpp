// The version bump of every tensor an op writes, as torch's own in-place
// ops do it: in the ADInplaceOrView kernel, which runs under
// torch.inference_mode() too (the Autograd kernels do not). A tensor saved
// for backward and then rotated in place under inference mode makes that
// backward raise instead of reading the rotated values.
#include "op/op_names.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <vector>

namespace rotary {
namespace {

void bump_written(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<at::Tensor> written;  // read before the redispatch consumes the stack
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    const c10::IValue& iv = (*stack)[first + i];
    if (alias && alias->isWrite() && iv.isTensor()) written.push_back(iv.toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
  }
  // After the kernel: a refused call wrote nothing and bumps nothing. An
  // inference tensor has no version (outside inference mode the op refuses
  // it before writing).
  for (const at::Tensor& t : written) {
    if (!t.is_inference()) torch::autograd::increment_version(t);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, ADInplaceOrView, m) {
  for (const char* name : detail::kInPlaceOps) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&bump_written>());
}

}  // namespace rotary
