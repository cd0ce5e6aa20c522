// torch.func's transforms (grad, vjp, jacrev; vmap over a graph) refuse
// custom Functions. Under them an op records its backward as a plain
// autograd node, as ATen's own ops record theirs; elsewhere its custom
// Function, which compiled autograd knows. Both run the same backward.
#pragma once

#include <ATen/FuncTorchTLS.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>

namespace rotary {
namespace detail {

// Whether a transform is active: what torch's own refusal tests (its stack
// is not in the public headers), so a caught error per call under one.
inline bool under_func_transforms() {
  const auto& tls = at::functorch::functorchTLSAccessor();  // null until a transform has run on this thread
  if (!tls) return false;
  try {
    tls->checkSupportsCppAutogradFunction();  // refuses exactly while a transform is active
  } catch (const c10::Error&) {
    return true;
  }
  return false;
}

// t.item<T>() for a check read on the host; where a transform leaves t no
// single value (per-sample under vmap: vmap's own error names nothing of
// ours), the c10::ValueError made of `refusal` instead.
template <typename T, typename... Msg>
T item_or_refuse(const at::Tensor& t, const Msg&... refusal) {
  try {
    return t.item<T>();
  } catch (const c10::Error&) {
    if (!under_func_transforms()) throw;
    TORCH_CHECK_VALUE(false, refusal...);
  }
  return T();
}

// A node whose backward maps the outputs' gradients to the inputs'.
using NodeBackward = std::function<torch::autograd::variable_list(const torch::autograd::variable_list&)>;
class FuncNode : public torch::autograd::Node {
 public:
  FuncNode(std::string name, NodeBackward backward) : name_(std::move(name)), backward_(std::move(backward)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(backward_, name_, ": trying to backward through the graph a second time (its saved tensors are ",
                "freed); pass retain_graph=True the first time");
    return backward_(grads);
  }
  std::string name() const override {
    return name_;
  }
  void release_variables() override {
    backward_ = nullptr;
  }

 private:
  std::string name_;
  NodeBackward backward_;
};

// The outputs of `forward` (run below autograd) recorded with a FuncNode
// whose inputs are `inputs` (undefined ones: no edge).
template <typename Forward>
torch::autograd::variable_list record_node(
    const char* name, const torch::autograd::variable_list& inputs, NodeBackward backward, const Forward& forward) {
  std::shared_ptr<FuncNode> node(new FuncNode(name, std::move(backward)), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::variable_list outs;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    outs = forward();
  }
  torch::autograd::set_history(outs, node);
  return outs;
}

}  // namespace detail
}  // namespace rotary
