// What the backward pass of a rotation needs besides q and k, saved into and
// loaded from an autograd context: the RoPE ops' and the prologue op's.
#pragma once

#include <rotary/ops.h>

#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <ATen/core/grad_mode.h>

#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace rotary {
namespace detail {

using torch::autograd::AutogradContext;
using OptTensor = std::optional<at::Tensor>;

// Everything but q and k, as the backward pass needs it.
struct RopeState {
  at::Tensor freqs;
  OptTensor offsets, position_ids, cu_seqlens, inv_freq;
  c10::SymInt start_pos;
  bool interleaved;
  bool inverse;
  std::string layout;
  int64_t rotary_offset;
  std::optional<std::vector<int64_t>> pair_axes;

  at::OptionalIntArrayRef axes() const {
    return pair_axes ? at::OptionalIntArrayRef(*pair_axes) : at::OptionalIntArrayRef();
  }

  at::Tensor backward(const at::Tensor& grad) const {
    return apply_rope(grad, freqs, start_pos, interleaved, offsets, position_ids, !inverse, cu_seqlens, inv_freq, layout, rotary_offset, axes());
  }
  std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& gq, const at::Tensor& gk) const {
    return apply_rope_qk(gq, gk, freqs, start_pos, interleaved, offsets, position_ids, !inverse, cu_seqlens, inv_freq, layout, rotary_offset, axes());
  }
  // q's and k's gradients from their outputs' (undefined where none came).
  std::tuple<at::Tensor, at::Tensor> input_grads(const at::Tensor& gq, const at::Tensor& gk) const {
    if (gq.defined() && gk.defined()) return backward(gq, gk);
    return {gq.defined() ? backward(gq) : at::Tensor(), gk.defined() ? backward(gk) : at::Tensor()};
  }
};

inline RopeState state_of(const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  return {freqs, offsets, position_ids, cu_seqlens, inv_freq, std::move(start_pos), interleaved, inverse,
          std::string(layout), rotary_offset,
          pair_axes ? std::optional<std::vector<int64_t>>(pair_axes->vec()) : std::nullopt};
}

inline OptTensor defined_or_none(const at::Tensor& t) {
  return t.defined() ? OptTensor(t) : std::nullopt;
}

// The tables get no gradient: one that requires grad would silently get none.
inline void check_tables_no_grad(const at::Tensor& freqs, const OptTensor& inv_freq) {
  TORCH_CHECK_VALUE(
      !freqs.requires_grad(),
      "rotary: freqs requires grad, but gradients with respect to the frequency table are not ",
      "supported; pass freqs.detach() or register it as a buffer");
  TORCH_CHECK_VALUE(
      !(inv_freq && inv_freq->defined() && inv_freq->requires_grad()),
      "rotary: inv_freq requires grad, but gradients with respect to the frequencies are not supported; ",
      "pass inv_freq.detach() or register it as a buffer");
}

// The state a backward holds: its tables as this forward read them (a
// module's host-driven rule later installs new ones into the same buffers,
// set_data with no version bump), detached; tables that require grad are
// refused (check_tables_no_grad).
// Autograd cannot save an inference tensor: refused by name, not with
// torch's unnamed error from deep inside the graph's construction.
inline void check_savable(const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(
      !(t.defined() && t.is_inference()), "rotary: ", name, " is an inference tensor (made under ",
      "torch.inference_mode()), which autograd cannot save for backward; make it outside inference mode, or pass ",
      name, ".clone()");
}

inline RopeState held_for_backward(RopeState s) {
  check_tables_no_grad(s.freqs, s.inv_freq);
  check_savable("freqs", s.freqs);
  for (const auto& [name, t] : {std::pair<const char*, const OptTensor*>{"offsets", &s.offsets},
                                {"position_ids", &s.position_ids}, {"cu_seqlens", &s.cu_seqlens},
                                {"inv_freq", &s.inv_freq}}) {
    if (*t) check_savable(name, **t);
  }
  s.freqs = s.freqs.detach();
  if (s.inv_freq && s.inv_freq->defined()) s.inv_freq = s.inv_freq->detach();
  return s;
}

// held_for_backward's state with its tensors as SavedVariables, for a node
// (func_node.h): a later in-place change to one (offsets, ids) is caught when
// backward reads it, as save_for_backward catches it for a Function.
class SavedRopeState {
 public:
  explicit SavedRopeState(const RopeState& state)
      : state_(held_for_backward(state)), saved_(std::make_shared<std::vector<torch::autograd::SavedVariable>>()) {
    for (const OptTensor& t : {OptTensor(state_.freqs), state_.offsets, state_.position_ids, state_.cu_seqlens,
                               state_.inv_freq}) {
      saved_->emplace_back(t.value_or(at::Tensor()), /*is_output=*/false);
    }
  }
  RopeState get() const {
    const auto& v = *saved_;
    RopeState s = state_;
    s.freqs = v[0].unpack();
    s.offsets = defined_or_none(v[1].unpack());
    s.position_ids = defined_or_none(v[2].unpack());
    s.cu_seqlens = defined_or_none(v[3].unpack());
    s.inv_freq = defined_or_none(v[4].unpack());
    return s;
  }

 private:
  RopeState state_;
  std::shared_ptr<std::vector<torch::autograd::SavedVariable>> saved_;  // shared: a node's backward is copyable
};

// Forward mode: t's tangent (undefined: none), t without it (as a custom
// Function takes it: it refuses one), and whether any of ts has one.
inline at::Tensor tangent_of(const at::Tensor& t) {
  return t.defined() ? t._fw_grad(/*level=*/0) : at::Tensor();
}
inline at::Tensor primal_of(const at::Tensor& t) {
  return tangent_of(t).defined() ? t._fw_primal(/*level=*/0) : t;
}
// t's tangent, or zeros where it has none (q's and k's rotate together).
inline at::Tensor tangent_or_zeros(const at::Tensor& t) {
  const at::Tensor d = tangent_of(t);
  return d.defined() ? d : at::zeros_like(t);
}
// An in-place op's new tangent for t: written into the tangent t has (torch
// requires it there), or set where it has none.
inline void set_in_place_tangent(at::Tensor& t, const at::Tensor& tangent) {
  at::Tensor had = tangent_of(t);
  t._set_fw_grad(had.defined() ? had.copy_(tangent) : tangent, /*level=*/0, /*is_inplace_op=*/true);
}
inline bool any_tangent(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) {
    if (tangent_of(*t).defined()) return true;
  }
  return false;
}

// An optional tensor as check_no_tangent takes it (null when absent).
inline const at::Tensor* or_null(const OptTensor& t) {
  return t ? &*t : nullptr;
}

// Forward-mode AD where no tangent is computed: the kernels run below
// autograd, so it would be dropped (a zero jvp). Refused, naming the tensor.
// The rotations compute q's and k's, and the prologue the weights' as well,
// in place too (autograd.cpp, norm_autograd.cpp).
inline void check_no_tangent(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> ts) {
  for (const auto& [name, t] : ts) {
    TORCH_CHECK_NOT_IMPLEMENTED(
        !(t && t->defined() && t->_fw_grad(/*level=*/0).defined()), op, ": ", name,
        " carries a forward-mode tangent (torch.func.jvp / jacfwd, torch.autograd.forward_ad); forward mode is ",
        "served for q, k (x) of apply_rope, apply_rope_qk, their in-place forms and apply_rope_cos_sin, and for ",
        "q, k and the weights of apply_qk_norm_rope and apply_qk_norm_rope_, not for ", name, " here");
  }
}

// The saved tensors are the state's five, then `extra` (from index
// kSavedRope on).
constexpr size_t kSavedRope = 5;
inline void save_state(AutogradContext* ctx, const RopeState& state, const std::vector<at::Tensor>& extra = {}) {
  const RopeState s = held_for_backward(state);
  std::vector<at::Tensor> saved = {s.freqs, s.offsets.value_or(at::Tensor()), s.position_ids.value_or(at::Tensor()),
                                   s.cu_seqlens.value_or(at::Tensor()), s.inv_freq.value_or(at::Tensor())};
  saved.insert(saved.end(), extra.begin(), extra.end());
  ctx->save_for_backward(saved);
  ctx->saved_data["start_pos"] = s.start_pos;
  ctx->saved_data["interleaved"] = s.interleaved;
  ctx->saved_data["inverse"] = s.inverse;
  ctx->saved_data["layout"] = s.layout;
  ctx->saved_data["rotary_offset"] = s.rotary_offset;
  if (s.pair_axes) ctx->saved_data["pair_axes"] = *s.pair_axes;
}

// `saved`: ctx->get_saved_variables(), read once per backward (a
// non-reentrant checkpoint unpacks each saved tensor only once).
inline RopeState load_state(AutogradContext* ctx, const std::vector<at::Tensor>& saved) {
  return {saved[0],
          defined_or_none(saved[1]),
          defined_or_none(saved[2]),
          defined_or_none(saved[3]),
          defined_or_none(saved[4]),
          ctx->saved_data["start_pos"].toSymInt(),
          ctx->saved_data["interleaved"].toBool(),
          ctx->saved_data["inverse"].toBool(),
          ctx->saved_data["layout"].toStringRef(),
          ctx->saved_data["rotary_offset"].toInt(),
          ctx->saved_data.count("pair_axes") ? std::optional<std::vector<int64_t>>(ctx->saved_data["pair_axes"].toIntVector())
                                             : std::nullopt};
}

// The in-place ops are not differentiable: they would overwrite a tensor that
// autograd may need. They refuse such inputs; the ADInplaceOrView kernel
// (inplace_or_view.cpp) bumps the version counters, so a later misuse of a
// saved tensor is caught.
// `how`: what the op does that is not differentiable; `out_of_place`: the op
// has an out-of-place form (the cache writes have none).
inline void check_no_grad(const char* op, const char* name, const at::Tensor& t,
                          const char* how = "in-place rotation", bool out_of_place = true) {
  TORCH_CHECK_VALUE(
      !(at::GradMode::is_enabled() && t.requires_grad()), op, ": ", name, " requires grad; ", how,
      " is not differentiable. ", out_of_place ? "Use the out-of-place op" : "It has no out-of-place form: pass ",
      out_of_place ? "" : name, out_of_place ? "" : ".detach()", ", or run under torch.no_grad() / inference mode");
}

// In place, tables that require grad would silently get no gradient.
inline void check_no_grad_tables(const at::Tensor& freqs, const OptTensor& inv_freq) {
  if (at::GradMode::is_enabled()) check_tables_no_grad(freqs, inv_freq);
}

// The fp8 scales get no gradient (their outputs are float8, not differentiable).
inline void check_no_grad_scales(const char* op, std::initializer_list<std::pair<const char*, OptTensor>> scales) {
  for (const auto& [name, t] : scales) {
    TORCH_CHECK_VALUE(
        !(at::GradMode::is_enabled() && t && t->defined() && t->requires_grad()), op, ": ", name,
        " requires grad, but the float8 values it scales are not differentiable; pass ", name, ".detach()");
    check_no_tangent(op, {{name, or_null(t)}});
  }
}

// The fused cache ops write k and v into the caches: not differentiable
// (v is only read, but the cache it lands in would have no graph).
inline void check_no_grad_kv(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& freqs, const OptTensor& inv_freq) {
  check_no_tangent(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"k_cache", &k_cache}, {"v_cache", &v_cache},
                        {"freqs", &freqs}, {"inv_freq", or_null(inv_freq)}});
  check_no_grad(op, "q", q, "in-place rotation", false);
  check_no_grad(op, "k", k, "in-place rotation", false);
  check_no_grad(op, "k_cache", k_cache, "the cache write", false);
  check_no_grad(op, "v_cache", v_cache, "the cache write", false);
  TORCH_CHECK_VALUE(
      !(at::GradMode::is_enabled() && v.requires_grad()), op, ": v requires grad; the cache write is not ",
      "differentiable (v_cache would hold v with no graph). Pass v.detach(), or run under torch.no_grad() / ",
      "inference mode");
  check_no_grad_tables(freqs, inv_freq);
}

}  // namespace detail
}  // namespace rotary
