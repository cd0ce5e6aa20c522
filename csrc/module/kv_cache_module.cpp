#include "checks/checks.h"
#include "freqs/host_tensor.h"
#include "params/layouts.h"

#include <rotary/front_end.h>
#include <rotary/kv_cache.h>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace rotary {

KVCacheImpl::KVCacheImpl(const KVCacheOptions& options_) : options(options_), in_effect_(options_) {
  reset();
}

void KVCacheImpl::reset() {
  const auto writing = begin_write("KVCache.reset", /*resets=*/true);
  const auto& o = options;
  TORCH_CHECK_VALUE(
      o.batch() >= 0 && o.kv_heads() > 0 && o.capacity() > 0 && o.head_dim() > 0, "KVCache: batch must be >= 0 and ",
      "kv_heads, capacity, head_dim > 0, got batch ", o.batch(), ", kv_heads ", o.kv_heads(), ", capacity ",
      o.capacity(), ", head_dim ", o.head_dim());
  TORCH_CHECK_VALUE(
      o.head_dim() % 2 == 0, "KVCache: head_dim must be even (RoPE rotates pairs of dims), got ", o.head_dim());
  // In double: the product of four int64 would wrap before the allocator saw it.
  const double elements = static_cast<double>(o.batch()) * static_cast<double>(o.kv_heads()) *
                          static_cast<double>(o.capacity()) * static_cast<double>(o.head_dim());
  TORCH_CHECK_VALUE(elements < 0x1p62, "KVCache: batch * kv_heads * capacity * head_dim = ", elements,
                    " elements per buffer is past what a tensor can hold; got capacity ", o.capacity());
  const CacheLayout layout = parse_cache_layout(o.layout());
  TORCH_CHECK_VALUE(layout == CacheLayout::kBHSD || layout == CacheLayout::kBSHD,
                    "KVCache: layout must be 'BHSD' or 'BSHD', got '", o.layout(), "'");
  const auto dt = o.dtype();
  TORCH_CHECK_TYPE(
      dt == torch::kFloat || dt == torch::kDouble || dt == torch::kHalf || dt == torch::kBFloat16 ||
          dt == torch::kFloat8_e4m3fn,
      "KVCache: dtype must be float32, float64, float16, bfloat16 or float8_e4m3fn, got ", dt);
  const bool fp8 = dt == torch::kFloat8_e4m3fn;
  for (const auto& [name, scale, heads] :
       {std::make_tuple("k_scale", o.k_scale(), &o.k_head_scales()), std::make_tuple("v_scale", o.v_scale(), &o.v_head_scales())}) {
    if (!scale && heads->empty()) continue;
    TORCH_CHECK_VALUE(!(scale && !heads->empty()), "KVCache: ", name, " is given per tensor and per head; pass one");
    TORCH_CHECK_VALUE(fp8, "KVCache: ", name, " is only for float8_e4m3fn caches; dtype ", dt, " is stored unscaled, got ",
                      name, " = ", scale ? c10::str(*scale) : c10::str(c10::ArrayRef<double>(*heads)));
    TORCH_CHECK_VALUE(heads->empty() || static_cast<int64_t>(heads->size()) == o.kv_heads(), "KVCache: ", name,
                      " per head must have kv_heads = ", o.kv_heads(), " entries, got ", heads->size());
    const std::vector<double> values = scale ? std::vector<double>{*scale} : *heads;
    for (const auto i : c10::irange(values.size())) {
      const float stored = static_cast<float>(values[i]);  // the buffer's value: NaN, overflow and underflow show here
      const std::string entry = heads->empty() ? name : std::string(name) + "[" + std::to_string(i) + "]";
      TORCH_CHECK_VALUE(std::isfinite(stored) && stored > 0.0f, "KVCache: ", entry,
                        " must be finite and > 0 as a float32, got ", values[i]);
    }
  }
  const auto device = k.defined() ? k.device() : torch::Device(torch::kCPU);
  if (device.is_cpu()) {  // the allocator's failure names neither the cache nor its capacity
    detail::check_host_bytes("KVCache", {o.batch(), o.kv_heads(), o.capacity(), o.head_dim()},
                             2 * c10::elementSize(dt), (std::string("two ") + c10::toString(dt)).c_str(),
                             "k and v of batch=" + std::to_string(o.batch()) + " x kv_heads=" +
                                 std::to_string(o.kv_heads()) + " x capacity=" + std::to_string(o.capacity()) +
                                 " x head_dim=" + std::to_string(o.head_dim()),
                             "pass a smaller capacity or batch");
  }
  const std::vector<int64_t> shape = layout == CacheLayout::kBHSD
      ? std::vector<int64_t>{o.batch(), o.kv_heads(), o.capacity(), o.head_dim()}
      : std::vector<int64_t>{o.batch(), o.capacity(), o.kv_heads(), o.head_dim()};
  TORCH_CHECK_VALUE(fp8 || !named_buffers(/*recurse=*/false).contains("k_scale"),
                    "KVCache.reset: a float8_e4m3fn cache cannot become ", dt,
                    " (its scales stay registered); build a new KVCache");
  const auto opts = torch::TensorOptions().dtype(dt).device(device);
  // Registered once; a later reset() replaces what the same buffers hold
  // with zeros, and empties the cache.
  const auto registered = named_buffers(/*recurse=*/false);
  // Allocated first: a reset that cannot allocate keeps the cache as it was.
  const torch::Tensor fresh_k = torch::zeros(shape, opts), fresh_v = torch::zeros(shape, opts);
  auto install = [&](torch::Tensor& member, const char* name, const torch::Tensor& fresh) {
    if (!registered.contains(name)) {
      member = register_buffer(name, fresh);
      return;
    }
    // set_data, not set_: the buffer takes the fresh dtype too (set_ kept
    // the old one, and failed on a narrower one half-way through a reset).
    torch::NoGradGuard no_grad;
    member.set_data(fresh);
  };
  // [] for one scale, [kv_heads] for one per head (built before any install).
  auto buffer = [&](const std::optional<double>& one, const std::vector<double>& heads) {
    const auto f32 = torch::dtype(torch::kFloat).device(device);
    if (heads.empty()) return torch::tensor(static_cast<float>(one.value_or(1.0)), f32);
    return torch::tensor(std::vector<float>(heads.begin(), heads.end()), f32);
  };
  const torch::Tensor fresh_ks = fp8 ? buffer(o.k_scale(), o.k_head_scales()) : torch::Tensor();
  const torch::Tensor fresh_vs = fp8 ? buffer(o.v_scale(), o.v_head_scales()) : torch::Tensor();
  install(k, "k", fresh_k);
  install(v, "v", fresh_v);
  if (fp8) {
    install(k_scale, "k_scale", fresh_ks);
    install(v_scale, "v_scale", fresh_vs);
  }
  length_ = 0;
  in_effect_ = o;
}

void KVCacheImpl::save(torch::serialize::OutputArchive& archive) const {
  torch::nn::Module::save(archive);
  archive.write("length", torch::tensor(length_), /*is_buffer=*/true);
  archive.write("layout", c10::IValue(in_effect_.layout()));
}

void KVCacheImpl::load(torch::serialize::InputArchive& archive) {
  const char* who = "KVCache.load";
  torch::Tensor saved[4];
  const char* names[4] = {"k", "v", "k_scale", "v_scale"};
  for (int i = 0; i < 4; ++i) archive.try_read(names[i], saved[i], /*is_buffer=*/true);
  // An fp8 cache's scales decode its bytes: without them the cache would read
  // the saved bytes with its own.
  const int needed = k_scale.defined() ? 4 : 2;
  for (int i = 0; i < needed; ++i) {
    TORCH_CHECK_VALUE(saved[i].defined(), who, ": the archive has no '", names[i], "'",
                      i < 2 ? "" : " (this float8_e4m3fn cache's scale); a KVCache loads all of its state or none");
  }
  // The length and layout travel too (save): an archive without them is
  // refused, as a partial state_dict is, since the cache would append at the wrong row.
  torch::Tensor length;
  c10::IValue layout;
  TORCH_CHECK_VALUE(archive.try_read("length", length, /*is_buffer=*/true), who,
                    ": the archive has no 'length'; a KVCache loads all of its state or none");
  TORCH_CHECK_VALUE(archive.try_read("layout", layout), who,
                    ": the archive has no 'layout'; a KVCache loads all of its state or none");
  TORCH_CHECK_VALUE(length.numel() == 1 && at::isIntegralType(length.scalar_type(), /*includeBool=*/false), who,
                    ": the saved 'length' must be one integer, got ", length.scalar_type(), " ", length.sizes());
  TORCH_CHECK_VALUE(layout.isString(), who, ": the saved 'layout' must be a string, got ", layout.tagKind());
  load_state(saved[0], saved[1], saved[2], saved[3], length.to(torch::kLong).item<int64_t>(), layout.toStringRef(),
             who);
}

void KVCacheImpl::load_state(const torch::Tensor& k_in, const torch::Tensor& v_in, const torch::Tensor& k_scale_in,
                             const torch::Tensor& v_scale_in, std::optional<int64_t> length,
                             const std::optional<std::string>& layout, const char* who) {
  const auto writing = begin_write(who);
  const std::pair<const char*, std::pair<const torch::Tensor*, torch::Tensor*>> pieces[4] = {
      {"k", {&k_in, &k}}, {"v", {&v_in, &v}}, {"k_scale", {&k_scale_in, &k_scale}}, {"v_scale", {&v_scale_in, &v_scale}}};
  for (const auto& [name, pair] : pieces) {
    const auto& [saved, mine] = pair;
    if (!saved->defined()) continue;
    // Every piece is checked before any is copied: a refused load leaves the cache as it was.
    detail::check_dense(who, (std::string("the saved '") + name + "'").c_str(), *saved);
    TORCH_CHECK_VALUE(!saved->is_meta(), who, ": the saved '", name, "' is a meta tensor (it holds no values)");
    TORCH_CHECK_VALUE(mine->defined(), who, ": the saved state has '", name, "' (a float8_e4m3fn cache's scale), ",
                      "this cache is ", in_effect_.dtype(), "; build the KVCache with the saved options");
    // Named before any piece is copied (torch would refuse only at the copy).
    TORCH_CHECK_VALUE(!mine->is_inference() || c10::InferenceMode::is_enabled(), who,
                      ": this cache was built under torch.inference_mode(), so its '", name,
                      "' cannot be updated outside it; load under torch.inference_mode(), or build the KVCache "
                      "outside it");
    // A scale saved as one ([] or [1]) means the same for every head: it
    // loads into a per-head buffer, and a [1] one into a [] buffer.
    const bool scale = mine == &k_scale || mine == &v_scale;
    const bool same_meaning = saved->sizes() == mine->sizes() || (scale && saved->numel() == 1 && saved->dim() <= 1);
    TORCH_CHECK_VALUE(same_meaning && saved->scalar_type() == mine->scalar_type(), who, ": saved ", name, " is ",
                      saved->scalar_type(), " ", saved->sizes(), ", this cache's is ", mine->scalar_type(), " ",
                      mine->sizes(), "; build the KVCache with the saved options");
  }
  for (const auto* scale : {&k_scale_in, &v_scale_in}) {
    if (!scale->defined()) continue;
    const auto values = scale->to(torch::kCPU, torch::kFloat).resolve_neg().contiguous();  // the values it shows
    for (const auto i : c10::irange(values.numel())) {
      const float value = values.data_ptr<float>()[i];
      TORCH_CHECK_VALUE(std::isfinite(value) && value > 0.0f, who, ": saved ",
                        scale == &k_scale_in ? "k_scale" : "v_scale", values.dim() ? "[" + std::to_string(i) + "]" : "",
                        " must be finite and > 0, got ", value);
    }
  }
  TORCH_CHECK_VALUE(!layout || *layout == in_effect_.layout(), who, ": the state was saved from a '", layout.value_or(""),
                    "' cache, this one is '", in_effect_.layout(), "'; build the KVCache with the saved options");
  TORCH_CHECK_VALUE(!length || (*length >= 0 && *length <= in_effect_.capacity()), who, ": saved length ",
                    length.value_or(0), " is outside [0, capacity = ", in_effect_.capacity(), "]");
  torch::NoGradGuard no_grad;
  // A saved piece that shares memory with this cache (its own v given as k)
  // is read before any piece is written: copied in turn, k <- v then v <- k
  // left both holding v.
  torch::Tensor sources[4];
  for (const auto i : c10::irange(4)) {
    const auto& saved = *pieces[i].second.first;
    if (!saved.defined()) continue;
    bool shares = false;
    for (const auto& piece : pieces) {
      const torch::Tensor& to = *piece.second.second;
      shares = shares || (to.defined() && saved.is_alias_of(to));
    }
    sources[i] = shares ? saved.clone() : saved;
  }
  for (const auto i : c10::irange(4)) {
    if (!sources[i].defined()) continue;
    torch::Tensor& mine = *pieces[i].second.second;
    // copy_ broadcasts [] over the heads; a [1] one into [] needs the reshape.
    mine.copy_(mine.dim() == 0 ? sources[i].reshape({}) : sources[i]);
  }
  if (length) length_ = *length;
}

void KVCacheImpl::pretty_print(std::ostream& stream) const {
  stream << "rotary::KVCache(batch=" << in_effect_.batch() << ", kv_heads=" << in_effect_.kv_heads()
         << ", capacity=" << in_effect_.capacity() << ", head_dim=" << in_effect_.head_dim() << ", layout="
         << in_effect_.layout() << ", dtype=" << in_effect_.dtype();
  // The scales the cache uses (a load may have changed them from the options').
  for (const auto& [name, scale] : {std::make_pair("k_scale", &k_scale), std::make_pair("v_scale", &v_scale)}) {
    if (!scale->defined() || scale->is_meta()) continue;
    const auto values = scale->to(torch::kCPU).contiguous();
    stream << ", " << name << "=";
    if (values.dim() == 0) {
      stream << values.item<float>();
    } else {
      stream << c10::ArrayRef<float>(values.data_ptr<float>(), values.numel());  // one per head
    }
  }
  stream << ", length=" << length_ << ")";
}

namespace {

// This process's pid, read once and again in each forked child: getpid() is
// a system call, and every append asks.
std::atomic<long> this_pid{0};
long current_pid() {
  static const int once = [] {
    this_pid.store(static_cast<long>(::getpid()));
    return pthread_atfork(nullptr, nullptr, [] { this_pid.store(static_cast<long>(::getpid())); });
  }();
  (void)once;
  return this_pid.load(std::memory_order_relaxed);
}

}  // namespace

KVCacheImpl::Writing KVCacheImpl::begin_write(const char* who, bool resets) {
  bool idle = false;
  const long self = current_pid();
  if (!busy_.on.compare_exchange_strong(idle, true, std::memory_order_acquire)) {
    const long writer = busy_.writer.load(std::memory_order_relaxed);
    bool forked = writer != 0 && writer != self;  // the flag was copied set by fork()
    bool take_over = false;
    if (forked && resets) {  // reset() rewrites every row and the length: one thread of the child takes over
      long seen = writer;
      take_over = busy_.writer.compare_exchange_strong(seen, self);
      forked = take_over;  // else another thread of this process took it over first
    }
    TORCH_CHECK(take_over || !forked, who, ": this KVCache was being written by process ", writer,
                " when this process was forked from it; that write never finishes here and may have left rows ",
                "half-written: reset() the cache, or build it in this process");
    TORCH_CHECK(take_over, who, ": another call is writing this KVCache (one writer at a time: each call appends at ",
                "length() and advances it); serialize the calls, or give each thread its own cache");
  }
  busy_.writer.store(self, std::memory_order_relaxed);
  return Writing(&busy_);
}

void KVCacheImpl::truncate(int64_t length) {
  const auto writing = begin_write("KVCache.truncate");
  TORCH_CHECK_VALUE(length >= 0 && length <= length_, "KVCache.truncate: length must be in [0, ", length_, "], got ",
                    length);
  length_ = length;
}

void KVCacheImpl::advance(int64_t tokens) {
  TORCH_CHECK_VALUE(tokens >= 0, "KVCache.advance: tokens must be >= 0, got ", tokens);
  TORCH_CHECK_INDEX(tokens <= in_effect_.capacity() - length_, "KVCache: appending ", tokens,
                    " positions to ", length_, " exceeds the capacity ", in_effect_.capacity());
  length_ += tokens;
}

std::shared_ptr<torch::nn::Module> KVCacheImpl::clone(const std::optional<torch::Device>& device) const {
  // Not Cloneable::clone: it resets the copy from `options`, a pending change
  // included, and the copy then said it held what its buffers do not. Built
  // from the options in effect, it takes the rows, scales and length, then
  // the pending change.
  torch::NoGradGuard no_grad;
  auto copy = std::make_shared<KVCacheImpl>(in_effect_);
  for (const auto& buffer : named_buffers(/*recurse=*/false)) {
    copy->named_buffers(/*recurse=*/false)[buffer.key()].set_data(clone_buffer(buffer.value(), device));
  }
  copy->length_ = length_;
  copy->options = options;
  copy->train(is_training());
  return copy;
}

void KVCacheImpl::to(torch::Device device, torch::Dtype /*dtype*/, bool non_blocking) {
  to(device, non_blocking);
}

void KVCacheImpl::to(torch::Dtype /*dtype*/, bool /*non_blocking*/) {}

void KVCacheImpl::to(torch::Device device, bool non_blocking) {
  refuse_meta_move("rotary::KVCache", device);
  const auto writing = begin_write("KVCache.to");  // an append on another thread writes the old buffers
  torch::nn::Module::to(device, non_blocking);
}

std::pair<torch::Tensor, torch::Tensor> KVCacheImpl::keys_values(torch::Dtype dtype) const {
  TORCH_CHECK_TYPE(
      dtype == torch::kFloat || dtype == torch::kDouble || dtype == torch::kHalf || dtype == torch::kBFloat16,
      "KVCache.keys_values: dtype must be float32, float64, float16 or bfloat16, got ", dtype);
  const bool bshd = parse_cache_layout(in_effect_.layout()) == CacheLayout::kBSHD;
  auto view = [&](const torch::Tensor& t, const torch::Tensor& scale) {
    auto filled = (bshd ? t.transpose(1, 2) : t).narrow(2, 0, length_);
    // fp8 x scale in float32 (exact for float32 and narrower), in float64 for float64.
    const auto acc = dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
    if (!scale.defined()) return filled;
    const auto s = scale.dim() == 0 ? scale.to(acc) : scale.to(acc).view({1, -1, 1, 1});  // per head: [B, H, L, D]
    return filled.to(acc).mul(s).to(dtype);
  };
  return {view(k, k_scale), view(v, v_scale)};
}

}  // namespace rotary
