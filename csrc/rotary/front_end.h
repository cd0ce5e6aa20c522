// The module shell both RotaryEmbedding modules run around the op: the C++
// module directly, the Python one through rotary._C.RopeTables. The span
// check, the host checks of a call, which tables it gets and when new ones
// are installed, inv_freq gating, and the fused cache append live here
// once; the modules keep only their buffers (and Python its traced forward).
#pragma once

#include <rotary/kv_cache.h>
#include <rotary/tables.h>

#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>
#include <c10/util/string_view.h>

#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace rotary {

// A module's buffers and how it installs new ones (host-driven rules).
struct ModuleBuffers {
  // (freqs, inv_freq) as the module holds them now: read under the lock of a
  // host-driven rule (another thread's call may have installed new ones).
  std::function<RopeTables::Held()> held;
  std::function<void(const RopeTableSet&)> install;
  // How messages name a dtype, as the caller's language writes it (empty:
  // c10's names, "BFloat16"; Python passes torch's, "torch.bfloat16").
  std::function<std::string(at::ScalarType)> dtype_name = {};
};

// head_dim of q ([.., head_dim]) holds the rotated span: c10::ValueError
// "RotaryEmbedding(dim=D): head_dim must be >= ..." naming both and q's
// shape (`shape`: as the caller's language writes it; default q.sizes()).
void check_span(const RotaryEmbeddingOptions& options, const at::Tensor& q, const std::string& shape = "");
// A C++ module's buffer for its clone(): moved to `device`, else copied.
at::Tensor clone_buffer(const at::Tensor& t, const std::optional<c10::Device>& device);
// c10::ValueError naming `who`, a C++ module, for a move to the meta device:
// its host reads need real buffers.
void refuse_meta_move(const char* who, c10::Device to);
// The sequence axis of a module call's 4-D layout (BHSD, BSHD, SBHD);
// c10::ValueError naming `who` for another.
int64_t module_seq_axis(c10::string_view layout, const char* who);

// The pair -> axis map of a module call: pair_axes with 3-D position_ids
// ([n_axes, batch, seq]); none for other positions, which under M-RoPE is a
// text token's rotation. An axial module (axes_dim) has no 1-D meaning: any
// other call is refused (refuse_axial_call).
at::OptionalIntArrayRef module_pair_axes(
    const RotaryEmbeddingOptions& options, const std::vector<int64_t>& pair_axes,
    const std::optional<at::Tensor>& position_ids);
// c10::ValueError: an axial module called without [n_axes, batch, seq]
// position_ids; `given` says what the call passed.
[[noreturn]] void refuse_axial_call(const RotaryEmbeddingOptions& options, const std::string& given);
// N-D position_ids ([n_axes, batch, seq]) given to a module with no pair -> axis map.
[[noreturn]] void refuse_nd_positions(const RotaryEmbeddingOptions& options, const std::string& shape);

// Runs op(freqs, inv_freq) for a call of seq_len rows at start_pos (or at
// offsets / position_ids), with the tables right for its reach: start_pos
// and the rows checked first, inv_freq passed only where the call may reach
// past the table (a short decode step skips its checks), new tables
// installed only once op returned.
template <typename Op>
auto run_module_call(
    RopeTables& tables,
    const ModuleBuffers& buffers,
    int64_t seq_len,
    int64_t start_pos,
    const std::optional<at::Tensor>& offsets,
    const std::optional<at::Tensor>& position_ids,
    Op&& op) {
  const bool has_positions = (offsets && offsets->defined()) || (position_ids && position_ids->defined());
  RopeTables::check_start_pos(start_pos);
  const int64_t reach = tables.host_driven() ? RopeTables::reach_of(seq_len, start_pos, offsets, position_ids) : 0;
  // Read once here (a rule with one state: its tables); a host-driven rule
  // reads them again under its lock, where another call may have installed.
  RopeTables::Held now = buffers.held();
  const auto held = [&] { return now = buffers.held(); };
  return tables.run(reach, now.first.device(), held, [&](const RopeTableSet* fresh) {
    const at::Tensor& f = fresh ? fresh->freqs : now.first;
    tables.check_rows(seq_len, start_pos, has_positions, f.size(0));
    const bool within = !has_positions && start_pos + seq_len <= f.size(0);
    std::optional<at::Tensor> inv;
    const at::Tensor& held_inv = fresh ? fresh->inv_freq : now.second;
    // One that requires grad goes to the op, which refuses it (it would get no gradient).
    if ((tables.extends_past_table() && !within) || held_inv.requires_grad()) inv = held_inv;
    auto out = op(f, inv);
    if (fresh) buffers.install(*fresh);
    return out;
  });
}

// forward_with_cache of both modules: rotates q and k (4-D in `layout`) in
// place at start_pos .. (default: the cache's length), writes the rotated k
// and v at rows length .. of the cache in one apply_rope_with_kv_cache_
// call, and advances the length. Returns (q, keys, values), the filled cache
// as [batch, kv_heads, length, head_dim] in q's dtype. Every check runs
// before anything is written.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_with_cache(
    RopeTables& tables, const ModuleBuffers& buffers, at::Tensor& q, at::Tensor& k, const at::Tensor& v,
    KVCacheImpl& cache, std::optional<int64_t> start_pos, c10::string_view layout = "BHSD");

}  // namespace rotary
