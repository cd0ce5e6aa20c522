#include "checks/checks.h"
#include "params/layouts.h"

#include <rotary/bounds.h>
#include <rotary/front_end.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

namespace rotary {

void check_span(const RotaryEmbeddingOptions& options, const at::Tensor& q, const std::string& shape) {
  const int64_t head_dim = q.dim() > 0 ? q.size(-1) : 0;
  // Both are >= 0 (check_options), so their sum fits in uint64.
  const uint64_t span = static_cast<uint64_t>(options.rotary_offset()) + static_cast<uint64_t>(options.dim());
  TORCH_CHECK_VALUE(
      bounds::span_fits(options.rotary_offset(), options.dim(), head_dim), "RotaryEmbedding(dim=", options.dim(),
      "): head_dim must be >= ",
      options.rotary_offset() ? "rotary_offset + dim = " + std::to_string(span) + " (the rotated span)"
                              : std::string("dim (the rotated width)"),
      ", got head_dim ", head_dim, " (shape ", shape.empty() ? c10::str(q.sizes()) : shape, ")");
}

void refuse_axial_call(const RotaryEmbeddingOptions& options, const std::string& given) {
  TORCH_CHECK_VALUE(
      false, "RotaryEmbedding(dim=", options.dim(), ", axes_dim=", c10::ArrayRef<int64_t>(options.axes_dim()),
      "): an axial module turns pair j by its axis' row of ",
      "position_ids; pass position_ids of shape [n_axes, batch, seq] = [", options.axes_dim().size(),
      ", batch, seq], got ", given);
}

void refuse_nd_positions(const RotaryEmbeddingOptions& options, const std::string& shape) {
  TORCH_CHECK_VALUE(
      false, "RotaryEmbedding(dim=", options.dim(), "): position_ids of shape ", shape, " are N-D positions ",
      "[n_axes, batch, seq], but this module turns every pair by one position: build it with mrope_section= ",
      "(M-RoPE), axes_dim= (axial RoPE) or pair_axes= (a map) for N-D positions, or pass [seq] or [batch, seq] ",
      "position_ids");
}

at::OptionalIntArrayRef module_pair_axes(
    const RotaryEmbeddingOptions& options, const std::vector<int64_t>& pair_axes,
    const std::optional<at::Tensor>& position_ids) {
  const bool given = position_ids && position_ids->defined();
  if (given && position_ids->dim() == 3 && !pair_axes.empty()) return pair_axes;
  if (!options.axes_dim().empty()) {
    refuse_axial_call(options, given ? "position_ids of shape " + c10::str(position_ids->sizes())
                                     : std::string("no position_ids"));
  }
  if (given && position_ids->dim() == 3) refuse_nd_positions(options, c10::str(position_ids->sizes()));
  return at::OptionalIntArrayRef();
}

namespace {

constexpr const char* kWho = "RotaryEmbedding.forward_with_cache";

// The axes of a module call's three 4-D layouts.
LayoutAxes checked_axes(c10::string_view layout, const char* who) {
  const Layout l = parse_layout(layout);
  TORCH_CHECK_VALUE(l == Layout::kBHSD || l == Layout::kBSHD || l == Layout::kSBHD, who,
                    ": layout must be 'BHSD', 'BSHD' or 'SBHD', got '", layout, "'");
  return axes_of(l);
}

}  // namespace

at::Tensor clone_buffer(const at::Tensor& t, const std::optional<c10::Device>& device) {
  return device && t.device() != *device ? t.to(*device) : t.clone();  // as Cloneable::clone copies
}

void refuse_meta_move(const char* who, c10::Device to) {
  TORCH_CHECK_VALUE(!to.is_meta(), who, ": a C++ module holds real buffers and cannot move to the meta device; build ",
                    "it where it runs (the Python rotary.RotaryEmbedding supports meta initialisation and to_empty)");
}

int64_t module_seq_axis(c10::string_view layout, const char* who) {
  return checked_axes(layout, who).seq;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_with_cache(
    RopeTables& tables,
    const ModuleBuffers& buffers,
    at::Tensor& q,
    at::Tensor& k,
    const at::Tensor& v,
    KVCacheImpl& cache,
    std::optional<int64_t> start_pos,
    c10::string_view layout) {
  const LayoutAxes ax = checked_axes(layout, kWho);
  const auto writing = cache.begin_write(kWho);  // length() is read, written at and advanced below
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q}, {"k", &k}, {"v", &v}}) {
    detail::check_defined(kWho, name, *t);
  }
  if (start_pos) RopeTables::check_start_pos(*start_pos);
  TORCH_CHECK_VALUE(q.dim() == 4, kWho, ": q must be 4-D ", std::string(layout), " ", ax.dims, ", got ", q.sizes());
  // The cache's shape in its own words (the op would name k_cache and v_cache, which the caller never passed).
  const KVCacheOptions& co = cache.options_in_effect();
  for (const auto& [what, t] : {std::pair<const char*, const at::Tensor*>{"k", &k}, {"v", &v}}) {
    TORCH_CHECK_VALUE(t->dim() == 4 && t->size(ax.batch) == co.batch() && t->size(ax.heads) == co.kv_heads() &&
                          t->size(3) == co.head_dim(),
                      kWho, ": ", what, " must be ", std::string(layout), " ", ax.dims, " with the KVCache's batch = ",
                      co.batch(), ", kv_heads = ", co.kv_heads(), " and head_dim = ", co.head_dim(), ", got shape ",
                      t->sizes());
  }
  detail::check_float_dtype(kWho, "k", k);  // before the advice below, which builds a cache of k's dtype
  const auto cache_dtype = co.dtype();
  const auto name = [&](at::ScalarType s) { return buffers.dtype_name ? buffers.dtype_name(s) : c10::str(s); };
  TORCH_CHECK_TYPE(
      cache_dtype == k.scalar_type() || cache_dtype == at::kFloat8_e4m3fn, kWho, ": the KVCache holds ",
      name(cache_dtype), " but k is ", name(k.scalar_type()),
      "; build the KVCache with dtype=", name(k.scalar_type()), " (or ", name(at::kFloat8_e4m3fn), "), or cast k");
  const int64_t seq = q.size(ax.seq), filled = cache.length(), capacity = co.capacity();
  TORCH_CHECK_INDEX(filled + seq <= capacity, kWho, ": appending ", seq, " positions to a cache holding ", filled,
                    " exceeds its capacity ", capacity);
  check_span(tables.options(), q);
  TORCH_CHECK_VALUE(
      tables.options().axes_dim().empty(), kWho, ": an axial module (axes_dim=",
      c10::ArrayRef<int64_t>(tables.options().axes_dim()), ") turns pair j by its axis' row of position_ids, which ",
      "forward_with_cache does not take; call forward(..., position_ids=[n_axes, batch, seq]) and write the cache, or ",
      "apply_rope_with_kv_cache_ with pair_axes and cache_positions");
  const int64_t pos = start_pos.value_or(filled);
  // Rows go at length() .. even when the rotation is elsewhere (start_pos).
  std::optional<at::Tensor> rows;
  if (pos != filled) {
    rows = at::arange(filled, filled + seq, at::dtype(at::kLong).device(q.device())).expand({q.size(ax.batch), seq});
  }
  const auto scale = [](const at::Tensor& s) { return s.defined() ? std::optional<at::Tensor>(s) : std::nullopt; };
  const auto& o = tables.options();
  run_module_call(tables, buffers, seq, pos, std::nullopt, std::nullopt, [&](const at::Tensor& f, const auto& inv) {
    apply_rope_with_kv_cache_(q, k, v, cache.k, cache.v, f, pos, o.interleaved(), std::nullopt, std::nullopt,
                              std::nullopt, inv, layout, rows, std::nullopt, co.layout(),
                              scale(cache.k_scale), scale(cache.v_scale), /*inverse=*/false, o.rotary_offset());
    return 0;
  });
  cache.advance(seq);
  auto [keys, values] = cache.keys_values(q.scalar_type());
  return {q, keys, values};
}

}  // namespace rotary
