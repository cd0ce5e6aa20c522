// Google Benchmark of the raw CPU kernel (rotary::cpu::rope_cpu, no
// dispatcher, outputs preallocated) against std::memcpy of the same bytes,
// plus the full dispatcher path (rotary::apply_rope_qk, fresh outputs)
// against at::clone of q and k. Sizes: the prefill case of bench.py,
// q [1, 32, 4096, 128] and k [1, 8, 4096, 128], fp32 and bf16.
//
//   ./build/bench_cpu --benchmark_min_time=0.5
//
// Arguments of each benchmark: /dtype(0 fp32, 1 bf16)/threads[/interleaved].
// bytes_per_second counts q and k read plus written, as bench.py does.
#include <rotary/freqs.h>
#include <rotary/ops.h>

#include "checks/checks.h"
#include "cpu/rope_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <climits>
#include <cstring>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace {

constexpr int64_t kBatch = 1, kHeadsQ = 32, kHeadsK = 8, kSeq = 4096, kDim = 128;
// The *Hot variants use 8 tokens: q and k (and their outputs) stay in L2, so
// they time the kernel's instructions rather than DRAM.
constexpr int64_t kHotSeq = 8;

at::ScalarType dtype_arg(int64_t i) {
  return i == 0 ? at::kFloat : at::kBFloat16;
}

const char* dtype_name(int64_t i) {
  return i == 0 ? "fp32" : "bf16";
}

struct Inputs {
  at::Tensor q, k, freqs;
  explicit Inputs(at::ScalarType dtype, int64_t seq = kSeq) {
    q = at::randn({kBatch, kHeadsQ, seq, kDim}).to(dtype);
    k = at::randn({kBatch, kHeadsK, seq, kDim}).to(dtype);
    freqs = rotary::rope_freqs(kDim, seq);
  }
  int64_t bytes_moved() const {
    return 2 * (q.nbytes() + k.nbytes());  // read + write
  }
};

// Launch description through the same validator the ops use.
rotary::detail::PreparedRope prepare(const Inputs& in, bool interleaved, bool in_place) {
  const std::optional<at::Tensor> none;
  const rotary::detail::RopeArgs args{0, interleaved, none, none, false, none, none, "BHSD"};
  return rotary::detail::prepare_rope("bench", in.q, &in.k, in.freqs, args, in_place);
}

void set_threads(benchmark::State& state, int64_t threads) {
  at::set_num_threads(static_cast<int>(threads));
  state.counters["threads"] = static_cast<double>(threads);
}

// std::memcpy of q's and k's bytes into buffers touched beforehand: the floor
// for the raw kernel, which also writes into preallocated outputs.
template <int64_t kS>
void BM_Memcpy(benchmark::State& state) {
  Inputs in(dtype_arg(state.range(0)), kS);
  set_threads(state, state.range(1));
  auto out_q = at::empty_like(in.q).zero_();
  auto out_k = at::empty_like(in.k).zero_();
  const auto nq = in.q.nbytes(), nk = in.k.nbytes();
  const auto* src_q = static_cast<const char*>(in.q.const_data_ptr());
  const auto* src_k = static_cast<const char*>(in.k.const_data_ptr());
  auto* dst_q = static_cast<char*>(out_q.data_ptr());
  auto* dst_k = static_cast<char*>(out_k.data_ptr());
  for (auto _ : state) {
    // Split like the kernel does, so the thread count means the same thing.
    at::parallel_for(0, 64, 1, [&](int64_t b, int64_t e) {
      const auto cq = nq / 64, ck = nk / 64;
      std::memcpy(dst_q + b * cq, src_q + b * cq, (e - b) * cq);
      std::memcpy(dst_k + b * ck, src_k + b * ck, (e - b) * ck);
    });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * in.bytes_moved());
  state.SetLabel(dtype_name(state.range(0)));
}

// The kernel alone: params built once by prepare_rope; its outputs are
// touched here before timing, so no page faults are timed.
template <int64_t kS>
void BM_Kernel(benchmark::State& state) {
  const auto dtype = dtype_arg(state.range(0));
  Inputs in(dtype, kS);
  set_threads(state, state.range(1));
  const bool interleaved = state.range(2) != 0;
  auto prepared = prepare(in, interleaved, /*in_place=*/false);
  prepared.out_q.zero_();
  prepared.out_k.zero_();
  for (auto _ : state) {
    rotary::cpu::rope_cpu(prepared.params, dtype);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * in.bytes_moved());
  state.SetLabel(std::string(dtype_name(state.range(0))) + (interleaved ? " interleaved" : " half"));
}

// The kernel in place (out == in): no separate output stream.
void BM_KernelInPlace(benchmark::State& state) {
  const auto dtype = dtype_arg(state.range(0));
  Inputs in(dtype);
  set_threads(state, state.range(1));
  const auto prepared = prepare(in, /*interleaved=*/true, /*in_place=*/true);
  for (auto _ : state) {
    rotary::cpu::rope_cpu(prepared.params, dtype);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * in.bytes_moved());
  state.SetLabel(std::string(dtype_name(state.range(0))) + " interleaved in-place");
}

// Full path: dispatcher, autograd wrapper, checks, fresh output allocation.
void BM_Dispatcher(benchmark::State& state) {
  Inputs in(dtype_arg(state.range(0)));
  set_threads(state, state.range(1));
  for (auto _ : state) {
    auto out = rotary::apply_rope_qk(in.q, in.k, in.freqs);
    benchmark::DoNotOptimize(std::get<0>(out).data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * in.bytes_moved());
  state.SetLabel(dtype_name(state.range(0)));
}

// The dispatcher path's floor: at::clone of q and k (fresh outputs too).
void BM_Clone(benchmark::State& state) {
  Inputs in(dtype_arg(state.range(0)));
  set_threads(state, state.range(1));
  for (auto _ : state) {
    auto a = in.q.clone();
    auto b = in.k.clone();
    benchmark::DoNotOptimize(a.data_ptr());
    benchmark::DoNotOptimize(b.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * in.bytes_moved());
  state.SetLabel(dtype_name(state.range(0)));
}

void DtypeThreads(benchmark::internal::Benchmark* b) {
  b->ArgNames({"dtype", "threads"});
  for (int64_t d : {0, 1})
    for (int64_t t : {1, 2}) b->Args({d, t});
}

void DtypeThreadsLayout(benchmark::internal::Benchmark* b) {
  b->ArgNames({"dtype", "threads", "interleaved"});
  for (int64_t d : {0, 1})
    for (int64_t t : {1, 2})
      for (int64_t i : {1, 0}) b->Args({d, t, i});
}

BENCHMARK(BM_Memcpy<kSeq>)->Name("BM_Memcpy")->Apply(DtypeThreads)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Kernel<kSeq>)->Name("BM_Kernel")->Apply(DtypeThreadsLayout)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_KernelInPlace)->Apply(DtypeThreads)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Clone)->Apply(DtypeThreads)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Dispatcher)->Apply(DtypeThreads)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Memcpy<kHotSeq>)->Name("BM_MemcpyHot")->Apply(DtypeThreads)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Kernel<kHotSeq>)->Name("BM_KernelHot")->Apply(DtypeThreadsLayout)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
#if defined(__GLIBC__)
  // As bench.py's --heap reuse does: keep freed blocks in the heap, so that BM_Clone and
  // BM_Dispatcher, which allocate 32-64 MiB outputs on every call, time the
  // copy and the kernel rather than page faults (glibc otherwise maps blocks
  // over 32 MiB afresh each time).
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
