// The states a dynamic rule's calls used, per reach, to check a
// checkpoint's recomputation of them (RopeTables::note_or_check_replay).
// Under RopeTables' lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace rotary {
namespace detail {

class ReplayNotes {
 public:
  // A forward call reaching `reach` with tables in `state`; `checkpointed`:
  // inside a non-reentrant checkpoint, so a backward will recompute it.
  void note(int64_t reach, int64_t state, bool checkpointed);
  // A recomputation reaching `reach` that would use `next`: the distinct
  // states its calls used (kMoreStates past kMaxStates of them), and
  // `served` when the checkpointed calls waiting for it (or all, when none
  // waits) used `next` alone; then, unless it will run again (a retained
  // graph, an inner checkpoint), one of those calls is done.
  std::vector<int64_t> recompute(int64_t reach, int64_t next, bool again, bool& served);

  static constexpr int64_t kMoreStates = -1;
  static constexpr size_t kMaxStates = 4;  // two already refuse; the rest only lengthen the message
  // Past it (after the notes no backward waits for are dropped), a
  // recomputation of an unnoted reach is refused.
  static constexpr size_t kMaxReaches = 4096;
  static constexpr int64_t kKeepSteps = 8;  // how long a checkpointed call waits for its backward

 private:
  struct Note {
    int64_t state;
    int64_t pending;  // checkpointed calls not yet recomputed
    int64_t step;  // when last noted
  };
  // The first call after a recomputation starts a step: the notes of calls
  // done with, or of any other call, go; a checkpointed call's note stays
  // until recomputed (a backward after a later forward: a pipeline
  // schedule), for kKeepSteps steps at most (its backward may never run).
  void next_step();
  // The notes of calls no backward waits for (pending 0), all of them.
  void drop_done();
  std::unordered_map<int64_t, std::vector<Note>> notes_;
  int64_t step_ = 0;
  bool replayed_ = false;
};

}  // namespace detail
}  // namespace rotary
