// The state machine behind both RotaryEmbedding modules (C++ and Python):
// the options, which tables they build, when a host-driven rule rebuilds
// them, how saved tables are checked and restored, and the lock.
#pragma once

#include <rotary/bounds.h>
#include <rotary/options.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace rotary {

// What one state of the rule builds; a module registers freqs and inv_freq
// as its buffers.
struct RopeTableSet {
  at::Tensor freqs;     // complex64 [rows, dim / 2], rows >= max_seq_len
  at::Tensor inv_freq;  // float64 [dim / 2]
  double attention_scaling = 1.0;
  int64_t state = 0;  // the seq_len the rule was evaluated at (0: the initial state)
};

namespace detail {
class ReplayNotes;  // module/replay_notes.h
// A mutex that a child process gets unlocked. fork() copies a mutex as it
// is, held by a thread the child does not have; a Python module's call
// waits for the GIL under its lock, so a fork while another thread calls is
// likely to copy it held. Every live one is made anew in the child
// (pthread_atfork, tables.cpp); a copy is a new, unlocked one.
struct ForkSafeMutex {
  ForkSafeMutex();
  ForkSafeMutex(const ForkSafeMutex&) : ForkSafeMutex() {}
  ForkSafeMutex& operator=(const ForkSafeMutex&) { return *this; }
  ~ForkSafeMutex();
  std::mutex mutex;
};
}  // namespace detail

// Positions must stay below this (the op's bound, rotary/bounds.h).
constexpr int64_t kMaxStartPos = kMaxPosition;

// "dynamic" and "longrope" are host-driven: they depend on how far a call
// reaches (one past its largest position, like HF's max(position_ids) + 1),
// and the tables are rebuilt on the host when that crosses the rule's
// threshold, as Hugging Face's dynamic_rope_update does:
//   dynamic   grows when the reach exceeds the length the table was last
//             built for (the table gains rows to cover it), and returns to
//             the original frequencies when the reach drops back under
//             max_position_embeddings;
//   longrope  uses long_factor while the reach exceeds
//             original_max_position_embeddings, short_factor otherwise.
// The other rules have one state and never rebuild.
//
// Transitions are transactional: run() and restore() build the new tables
// into locals, hand them to the caller, and record the new state only when
// the caller returned. A call that throws (a refused input, a failed
// allocation) leaves the state, and so the module, as it was.
//
// Threads: run() and restore() of a host-driven rule hold a lock for the
// whole transition, so each call sees the tables of its own reach. A copy
// gets a fresh lock and the same state.
//
// The state follows the tables a module holds, not only the last transition:
// run() is given the module's buffers, and a table this object built or met
// before brings its state back (functional_call puts the module's buffers
// back after a call that switched tables). A pair it never met (a move, a
// copy, tables passed to functional_call, either alone) tells its state by
// its inv_freq, checked as a load checks it, and its freqs must be that
// state's (refused by name when not: pieces of two states); under a trace
// (fake tensors) the current state holds.
class RopeTables {
 public:
  // Validates the options and the rule (c10::ValueError naming the field).
  // `state` is kept for host-driven rules only. build() refuses tables that
  // would not be finite; both modules build theirs at construction.
  explicit RopeTables(RotaryEmbeddingOptions options, int64_t state = 0);
  RopeTables(const RopeTables& other);
  RopeTables& operator=(const RopeTables& other);

  const RotaryEmbeddingOptions& options() const { return options_; }
  bool host_driven() const { return host_driven_; }
  // The seq_len the rule was last evaluated at (0: the initial state).
  int64_t state() const { return state_; }
  double attention_scaling() const { return attention_scaling_; }
  // Whether the op gets inv_freq, so positions past the table are computed
  // exactly (float64 angles only: that path is float64).
  bool extends_past_table() const { return options_.angle_dtype() == at::kDouble; }
  // The rows a grown float32-angle dynamic table stops at (or max_seq_len,
  // when larger): a far reach must not allocate one row per position; calls
  // past it are refused. A grown float64-angle table keeps row 0 alone.
  static constexpr int64_t kMaxGrownRows = int64_t{1} << 20;

  // The tables of `state` (not necessarily the current one) on `device`;
  // c10::ValueError naming the options when an entry would not be finite.
  RopeTableSet build(int64_t state, c10::Device device = c10::kCPU) const;
  // The state a call reaching `reach` needs (state() when none is rebuilt).
  int64_t state_for_reach(int64_t reach) const;

  // The reach of a call: one past its largest position. seq_len rows from
  // start_pos (+ offsets [] / [batch]), or the largest of the absolute
  // position_ids + 1 (their maximum is read on the host).
  static int64_t reach_of(
      int64_t seq_len,
      int64_t start_pos,
      const std::optional<at::Tensor>& offsets,
      const std::optional<at::Tensor>& position_ids);
  // Host-side checks of a module call: start_pos in [0, 2^60)
  // (c10::ValueError / c10::IndexError), and, with float32 angles (no
  // on-the-fly path), rows start_pos .. start_pos + seq_len - 1 inside a
  // table of `rows` rows (c10::IndexError).
  static void check_start_pos(int64_t start_pos);
  void check_rows(int64_t seq_len, int64_t start_pos, bool has_positions, int64_t rows) const;
  // update_for_reach's argument, one past the largest position: in [0, 2^60].
  void check_reach(int64_t reach) const;

  // The module's buffers (freqs, inv_freq), as held() returns them.
  using Held = std::pair<at::Tensor, at::Tensor>;
  // A pair's version counters (every in-place write through the dispatcher bumps them; not .data's).
  using Versions = std::optional<std::pair<uint32_t, uint32_t>>;

  // Runs op(fresh) with the tables right for a call reaching `reach`
  // (reach <= 0: the current state) of a module whose buffers held()
  // returns (read under the lock: another call may be installing). fresh is
  // nullptr when the held tables are right, else the new ones (on
  // `device`), which op must install when it succeeds. The new state is
  // recorded after op returned; not at all with record false (a trace,
  // torch.export, bakes the tables in and leaves the module as it was).
  // Under torch.jit.trace (no guards) it refuses, before op runs.
  template <typename HeldFn, typename Op>
  auto run(int64_t reach, c10::Device device, HeldFn&& held, Op&& op, bool record = true) -> decltype(op(nullptr)) {
    if (!host_driven_) return op(nullptr);
    refuse_jit_trace();
    std::lock_guard<std::mutex> lock(lock_.mutex);
    follow(held());
    const int64_t next = reach > 0 ? state_for_reach(reach) : state_;
    note_or_check_replay(reach, next);
    if (next == state_ && servable_) return op(nullptr);
    const RopeTableSet fresh = build(next, device);
    built_.reserve(built_.size() + 1);  // commit() cannot fail once op installed the tables
    auto out = op(&fresh);
    // The versions of the buffers now held: the C++ module installs by
    // set_data, its buffers' counters going on from where they were.
    if (record) {
      Versions installed = versions_of({fresh.freqs, fresh.inv_freq});
      try {
        installed = versions_of(held());
      } catch (...) {  // met afresh at the next call instead
      }
      commit(fresh, installed);
    }
    return out;
  }
  // Notes tables a module installed outside run() and restore() (at its
  // construction, after a move) as its own, of the current state: a write of
  // either before the next call then shows as one.
  void own(const Held& held);
  // The state of the tables held() returns (the module's buffers), followed
  // as run() does.
  template <typename HeldFn>
  int64_t state_of(HeldFn&& held) {
    if (!host_driven_) return state_;
    std::lock_guard<std::mutex> lock(lock_.mutex);
    follow(held());
    return state_;
  }

  // Checks saved buffers (either may be absent) against these options
  // (check_saved_tables) and calls install(tables) with the tables of the
  // state they match, rebuilt from the options on `device`; the state is
  // recorded after install returned. Throws c10::ValueError (nothing
  // installed) when they do not match. `who` starts the message.
  template <typename Install>
  void restore(
      const std::optional<at::Tensor>& freqs,
      const std::optional<at::Tensor>& inv_freq,
      const std::string& who,
      c10::Device device,
      Install&& install,
      std::optional<int64_t> tried = std::nullopt) {
    std::unique_lock<std::mutex> lock(lock_.mutex, std::defer_lock);
    if (host_driven_) lock.lock();
    const RopeTableSet fresh = build(saved_state(freqs, inv_freq, who, tried), device);
    prune_built();  // loads with no call between them would keep every dropped table's entry
    built_.reserve(built_.size() + 1);
    install(fresh);
    commit(fresh, versions_of({fresh.freqs, fresh.inv_freq}));  // the C++ module's: met afresh once, at the next call
  }

  // After a refused deletion of a table (torch.nn.utils.parametrize writes
  // a right_inverse's result into it, set_, before it deletes it): installs
  // the held tables again if they are still these options', else the tables
  // of the current state, built afresh on the held device. Meta tables hold
  // no values to have changed: left as they are.
  template <typename Install>
  void keep(const Held& held, const std::string& who, Install&& install) {
    if (held.first.is_meta() || held.second.is_meta()) return;
    const c10::Device device = held.first.device();
    try {
      restore(held.first, held.second, who, device, install);
    } catch (const c10::Error&) {
      int64_t current = 0;
      {
        std::lock_guard<std::mutex> lock(lock_.mutex);  // a call on another thread may be switching it
        current = state_;
      }
      const RopeTableSet built = build(current, device);
      restore(built.freqs, built.inv_freq, who, device, install, built.state);
    }
  }

  // How many built or met tables it keeps a state for: those alive, and at
  // most one dropped since the last call or load (tests: it stays bounded).
  size_t tracked_tables() const {
    std::lock_guard<std::mutex> lock(lock_.mutex);
    return built_.size();
  }

  // One line for messages: dim, max_seq_len, theta, rope_type, angle_dtype.
  std::string describe() const;

 private:
  int64_t saved_state(
      const std::optional<at::Tensor>& freqs,
      const std::optional<at::Tensor>& inv_freq,
      const std::string& who,
      std::optional<int64_t> tried = std::nullopt) const;
  // A dynamic rule at reach >= max_position_embeddings uses a table that
  // depends on the calls before: a checkpoint's recomputation (a call during
  // a backward pass) of a call whose state has changed since would turn by
  // another table, silently. Each call notes the state it used for its
  // reach; a recomputation is served when every call of that reach used the
  // state it would use, else refused (module/replay_notes.h keeps the notes).
  // Under the lock.
  void note_or_check_replay(int64_t reach, int64_t next);
  // torch.jit.trace keeps no guards: it would serve every later call with
  // the traced call's tables. Refused by name (c10::Error).
  void refuse_jit_trace() const;
  std::shared_ptr<detail::ReplayNotes> notes_;
  void commit(const RopeTableSet& tables, Versions versions) noexcept {  // room reserved before the install
    state_ = tables.state;
    attention_scaling_ = tables.attention_scaling;
    servable_ = true;
    if (!host_driven_) return;  // one state: nothing to follow
    built_.push_back({tables.freqs.unsafeGetTensorImpl()->unsafe_storage().getWeakStorageImpl(),
                      weak_storage(tables.inv_freq), tables.state,
                      tables.attention_scaling, versions, true, true, false});
  }
  // A table's storage (nullptr when it is undefined or has none: a trace's
  // fake or functional tensor), and the same held weakly (none then).
  static const c10::StorageImpl* storage_of(const at::Tensor& t);
  static std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> weak_storage(const at::Tensor& t);
  // The version counters of a pair (every in-place write bumps them); none
  // for inference tensors, which keep no counter.
  static Versions versions_of(const Held& held) noexcept;
  // Whether inv_freq is, bit for bit, `state`'s (the re-read of a pair
  // written with the same tables skips the search for its state).
  bool holds_state_inv(const at::Tensor& inv_freq, int64_t state) const;
  // Why freqs is not `state`'s table (empty when it is): its shape, then rows 0, 1 and
  // the last, where two states' tables differ most (a whole-table read is a load's).
  std::string freqs_mismatch(const at::Tensor& freqs, int64_t state) const;
  // Under the lock: the state of the tables `held`, noted for next time.
  void follow(const Held& held);
  // Under the lock: drops the entries of tables freed since.
  void prune_built();

  // The storages of the pairs this object built or met (both tables: a
  // functional_call may swap one alone), with their states (the C++ module
  // installs by set_data: its buffer keeps its TensorImpl; a weak reference
  // keeps an address from being reused), and
  // the pair's versions then: a pair written in place since (DDP's
  // broadcast_buffers copies rank 0's tables into every rank) is read again,
  // and rebuilt when it holds another state than the module's own.
  // servable: the tables serve `state` (else the next call rebuilds).
  // read: its values were read (else, met under a transform, the first call that can reads them);
  // written: then, a write over the module's own tables (read, they leave it its state).
  struct Built {
    c10::weak_intrusive_ptr<c10::StorageImpl> freqs;
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> inv_freq;
    int64_t state;
    double attention_scaling;
    Versions versions;  // none: inference tensors, which keep no counter and show no write
    bool servable = true;
    bool read = true;
    bool written = false;
    // Whether it is the entry of the pair with these storages.
    bool is(const c10::StorageImpl* f, const c10::StorageImpl* inv) const {
      return freqs._unsafe_get_target() == f && (inv_freq ? inv_freq->_unsafe_get_target() : nullptr) == inv;
    }
  };
  std::vector<Built> built_;
  bool servable_ = true;  // the tables held may serve state_ (see Built)

  RotaryEmbeddingOptions options_;  // scaling() with its defaults filled in
  bool host_driven_ = false;
  int64_t state_ = 0;
  double attention_scaling_ = 1.0;
  mutable detail::ForkSafeMutex lock_;
};

// Checks tables saved from a RotaryEmbedding (its `freqs` complex64 [rows,
// dim / 2] and `inv_freq` float64 [dim / 2]; either may be absent) against
// what a module with `options` builds: dtype, device (not meta) and shape,
// row count (max_seq_len; more for a grown "dynamic" rule), inv_freq to
// 1e-12 relative, and every table entry to 2^-22 (times the attention
// scaling), which tells another theta, rule, factor or angle_dtype apart (a
// table nearer to the other angle_dtype's than to its own is refused too).
// The host-driven rules may have been saved in any of their states (`tried`:
// one to try as well, the state a copy was made in). Returns the sequence
// length of the state that matches (0: the initial one).
// Throws c10::ValueError naming the buffer, the options and the first
// mismatch. `who` starts the message.
int64_t check_saved_tables(
    const RotaryEmbeddingOptions& options,
    const std::optional<at::Tensor>& freqs,
    const std::optional<at::Tensor>& inv_freq,
    const std::string& who = "RotaryEmbedding.load",
    std::optional<int64_t> tried = std::nullopt);

}  // namespace rotary
