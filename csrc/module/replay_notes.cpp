// The replay notes, and RopeTables' checks of a call against what will
// replay it: autograd's recomputation, torch.jit.trace's graph.
#include "module/replay_notes.h"

#include <rotary/tables.h>

#include <ATen/SavedTensorHooks.h>
#include <c10/core/AutogradState.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <algorithm>
#include <iterator>
#include <sstream>

namespace rotary {
namespace detail {

void ReplayNotes::next_step() {
  ++step_;
  for (auto it = notes_.begin(); it != notes_.end();) {
    auto& notes = it->second;
    notes.erase(std::remove_if(notes.begin(), notes.end(),
                               [&](const Note& n) { return n.pending == 0 || step_ - n.step > kKeepSteps; }),
                notes.end());
    it = notes.empty() ? notes_.erase(it) : std::next(it);
  }
}

void ReplayNotes::note(int64_t reach, int64_t state, bool checkpointed) {
  if (replayed_) next_step();
  replayed_ = false;
  auto it = notes_.find(reach);  // a decode step adds one reach: O(1), not a scan
  if (it == notes_.end()) {
    if (notes_.size() >= kMaxReaches) drop_done();  // a long no_grad loop's notes: none waits for a backward
    if (notes_.size() >= kMaxReaches) return;
    it = notes_.emplace(reach, std::vector<Note>{}).first;
  }
  auto& notes = it->second;
  const auto of = [&](int64_t s) {
    return std::find_if(notes.begin(), notes.end(), [&](const Note& n) { return n.state == s; });
  };
  auto found = of(state);
  if (found == notes.end() && notes.size() >= kMaxStates && checkpointed) {
    // Room for a call a backward waits for (those alone count then): the notes no backward waits for go.
    notes.erase(std::remove_if(notes.begin(), notes.end(), [](const Note& n) { return n.pending == 0; }), notes.end());
    found = notes.end();
  }
  if (found == notes.end() && notes.size() >= kMaxStates) found = of(kMoreStates);
  if (found == notes.end()) {
    found = notes.insert(notes.end(), Note{notes.size() >= kMaxStates ? kMoreStates : state, 0, step_});
  }
  found->pending += checkpointed ? 1 : 0;
  found->step = step_;
}

void ReplayNotes::drop_done() {
  for (auto it = notes_.begin(); it != notes_.end();) {
    auto& notes = it->second;
    notes.erase(std::remove_if(notes.begin(), notes.end(), [](const Note& n) { return n.pending == 0; }), notes.end());
    it = notes.empty() ? notes_.erase(it) : std::next(it);
  }
}

std::vector<int64_t> ReplayNotes::recompute(int64_t reach, int64_t next, bool again, bool& served) {
  replayed_ = true;
  served = false;
  std::vector<int64_t> used;
  const auto it = notes_.find(reach);
  if (it == notes_.end()) return used;
  auto& notes = it->second;
  for (const Note& n : notes) used.push_back(n.state);
  // Calls that wait for this backward (checkpointed) speak for the reach; the
  // others (a no_grad rollout's) only when none waits.
  const auto waits = [](const Note& n) { return n.pending > 0; };
  const bool waiting = std::any_of(notes.begin(), notes.end(), waits);
  const auto counted = [&](const Note& n) { return !waiting || waits(n); };
  const auto first = std::find_if(notes.begin(), notes.end(), counted);
  served = first->state == next && std::count_if(notes.begin(), notes.end(), counted) == 1;
  if (served && waiting && !again) --first->pending;
  return used;
}

}  // namespace detail

void RopeTables::note_or_check_replay(int64_t reach, int64_t next) {
  const RopeScaling& s = options_.scaling();
  if (reach <= 0 || rope_type_of(s) != RopeType::Dynamic || reach < *s.max_position_embeddings()) return;
  if (!notes_) notes_ = std::make_shared<detail::ReplayNotes>();
  // Inside a reentrant checkpoint (a Python autograd.Function's forward) grad and forward grad are both off,
  // where no_grad leaves forward grad on; a function that turns grad back on (enable_grad) leaves forward grad off.
  const bool in_forward_of_function = !c10::AutogradState::get_tls_state().get_fw_grad_mode();
  if (torch::autograd::get_current_graph_task_id() == -1) {
    if (c10::InferenceMode::is_enabled()) return;  // never recomputed
    // Inside torch.utils.checkpoint(use_reentrant=False) its saved-tensor hooks are on. Other hooks and
    // Functions look the same: a note that waits for nothing, kept kKeepSteps steps.
    notes_->note(reach, next, in_forward_of_function || !at::SavedTensorDefaultHooks::get_tls_state().stack.empty());
    return;
  }
  // An inner reentrant checkpoint's forward, run by an outer one's recomputation (grad on or off inside),
  // is checked, not done with: its own backward recomputes the call again. A non-reentrant inner one looks
  // like a plain recomputation (hooks on, grad on) and is counted twice (docs/api.md). Retained graphs may
  // run again too.
  const bool again = in_forward_of_function || torch::autograd::get_current_graph_task_keep_graph();
  bool served = false;
  const std::vector<int64_t> used = notes_->recompute(reach, next, again, served);
  if (served) return;
  const auto length = [&](int64_t state) { return state > 0 ? state : *s.max_position_embeddings(); };
  std::ostringstream ran;
  for (size_t i = 0; i < used.size(); ++i) {
    ran << (i ? ", " : "");
    if (used[i] == detail::ReplayNotes::kMoreStates) {
      ran << "and others";
    } else {
      ran << length(used[i]);
    }
  }
  TORCH_CHECK_VALUE(false, "RotaryEmbedding(", describe(), "): called during a backward pass (torch.utils.checkpoint ",
                    "recomputing it) with positions up to ", reach - 1, ", past max_position_embeddings = ",
                    *s.max_position_embeddings(), ", where a dynamic rule's table depends on the calls before: it ",
                    "would now turn by the table of length ", length(next),
                    used.empty() ? std::string(", and no call of this reach was noted")
                                 : ", but calls of this reach turned by length(s) " + ran.str(),
                    ". Call the module outside the checkpointed function; or call update_for_reach(", reach,
                    ") before it and pass the module's freqs and inv_freq into it, for rotary.apply_rope_qk ",
                    "(docs/api.md)");
}

void RopeTables::refuse_jit_trace() const {
  TORCH_CHECK(!torch::jit::tracer::isTracing(), "RotaryEmbedding(", describe(), "): its rule rebuilds the tables ",
              "on the host from each call's reach, which torch.jit.trace would freeze at the traced call's; use ",
              "rotary.RotaryEmbedding under torch.compile or torch.export, or a rule without a host-driven state ",
              "(docs/deploy.md)");
}

}  // namespace rotary
