#include "module/replay_notes.h"

#include <algorithm>
#include <iterator>

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
}  // namespace rotary
