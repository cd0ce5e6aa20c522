// The CPU kernel, compiled once per capability (CMake: DEFAULT, AVX2, AVX512
// with ATen's -m flags, AVX512_BF16, all with -ffp-contract=off) on
// at::vec::Vectorized<acc_t>.
// Heads-major runs walk a block of heads over the tile's tokens, so reads and
// writes are long sequential streams; token-major runs walk token by token
// over the heads. The coefficients of one token are loaded once per block of
// heads. Math in acc_t (fp32 for fp32/fp16/bf16, fp64 for fp64), one rounding
// to the storage type at the end.
#include "rope_kernel.h"
#include "vec_isa.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <utility>
#include <type_traits>

namespace rotary {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

// Heads that share one load of the coefficients.
constexpr int kHeadBlock = 4;
// Stores of `bytes` that fill one 64-byte line. Each head writes them back
// to back, so that a streamed line is complete before the next head's
// stores begin: AVX2 stores 32 bytes (16 for fp16), AVX-512 a line (32
// bytes for fp16).
template <int64_t bytes>
constexpr int kPerLine = bytes >= 64 ? 1 : int(64 / bytes);
// Software prefetch distance along a walk: 8 tokens ahead in each of a
// heads-major block's runs, and 8 KiB ahead in a token-major walk (its
// heads, then the next token's), about as much in flight (bf16's 2 KiB
// left the HF layout 1.1-1.3x `clone`), where the driver asks for it
// (Run::prefetch). A one-token walk (decode) does not prefetch its input:
// its data is cache-resident, and fp32 decode was 5% slower.
constexpr int64_t kPrefetchVectors = 8;
constexpr int64_t kPrefetchWalkBytes = 8 << 10;

// Prefetches the lines of [p, p + bytes), for reading or (kWrite) writing.
// Always inlined: g++ 12 deleted the calls to an outlined function whose only
// effect was a prefetch.
template <bool kWrite = false>
C10_ALWAYS_INLINE void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, kWrite ? 1 : 0, 3);
}

// Vector (t, h) moved n vectors on in (token, head) order, without a division.
inline void walk_on(int64_t& t, int64_t& h, int64_t n, int64_t heads) {
  for (h += n; h >= heads; h -= heads) ++t;
}

// Interleaved bf16 rows are pairs in the x86 builds (rotate_bf16_pairs
// loads c and s as they are); every other interleaved row is per element
// (rope_kernel.h).
template <typename scalar_t>
constexpr bool kPairWords =
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    std::is_same_v<scalar_t, c10::BFloat16>;
#else
    false;
#endif

// Pair j's c and s in a token's row: c[j * step] and s[j * step].
template <typename acc_t>
struct PairsOf {
  const acc_t* c;
  const acc_t* s;
  int64_t step;
};
template <typename scalar_t, typename acc_t>
PairsOf<acc_t> pairs_of(const acc_t* row, int64_t dim, bool interleaved) {
  if (!interleaved || kPairWords<scalar_t>) return {row, row + dim / 2, 1};
  return {row, row + dim + 1, 2};  // (c, c) and (-s, s) per pair: c at 2j, s at 2j + 1 of the second
}

// Scalar rotation of one vector from pair `from` on: strided vectors, and
// the tail after the vector loop.
template <typename scalar_t, typename acc_t>
void rotate_scalar(
    const scalar_t* in, int64_t is, scalar_t* out, int64_t os, const acc_t* row, int64_t dim, bool interleaved,
    int64_t from) {
  const PairsOf<acc_t> cs = pairs_of<scalar_t>(row, dim, interleaved);
  // Pair j's members: (2j, 2j + 1) interleaved, (j, j + dim / 2) half.
  const int64_t half = dim / 2, step = interleaved ? 2 : 1, other = interleaved ? 1 : half;
  for (int64_t j = from; j < half; ++j) {
    const int64_t e = j * step;
    const acc_t x0 = static_cast<acc_t>(in[e * is]), x1 = static_cast<acc_t>(in[(e + other) * is]);
    const acc_t c = cs.c[j * cs.step], s = cs.s[j * cs.step];
    out[e * os] = to_storage<scalar_t>(x0 * c - x1 * s);
    out[(e + other) * os] = to_storage<scalar_t>(x0 * s + x1 * c);
  }
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// bf16, interleaved: a 32-bit word holds one pair, so its members widen to
// fp32 with a shift and a mask (no pair swap), rotate with the pair's c and
// s as loaded, and round back into one word (bf16_words). The same products,
// sums and rounding as the generic path: the same bits. A head's words of a
// streamed line are stored back to back. Returns how many pairs it rotated
// (a multiple of L).
template <bool NT, int M>
inline int64_t rotate_bf16_pairs(
    const c10::BFloat16* const* in, c10::BFloat16* const* out, const float* c, const float* s, int64_t half) {
  using Vec = Vectorized<float>;
  constexpr int64_t L = Vec::size();  // pairs per vector
  constexpr int U = NT ? kPerLine<4 * L> : 1;  // stores of L pairs per streamed line
  int64_t j = 0;
  for (; j + L * U <= half; j += L * U) {
    Vec cp[U], sp[U];
    for (int u = 0; u < U; ++u) cp[u] = Vec::loadu(c + j + L * u), sp[u] = Vec::loadu(s + j + L * u);
    for (int h = 0; h < M; ++h) {
      decltype(bf16_words(Vec(), Vec())) w[U];
      for (int u = 0; u < U; ++u) {
        Vec x0, x1;
        bf16_members(in[h] + 2 * (j + L * u), x0, x1);
        w[u] = bf16_words(x0 * cp[u] - x1 * sp[u], x0 * sp[u] + x1 * cp[u]);
      }
      for (int u = 0; u < U; ++u) put<NT>(out[h] + 2 * (j + L * u), w[u]);
    }
  }
  return j;
}

// bf16, rotate_half: 2L pairs at a time. A 32-bit word of either half holds
// two adjacent elements, so its even and odd members widen with a shift and
// a mask and rotate with the same members of the other half; bf16_words
// puts them back in element order. Same products, sums and rounding as the
// generic path: the same bits. Returns how many pairs it rotated (a
// multiple of 2L).
template <bool NT, int M>
inline int64_t rotate_bf16_halves(
    const c10::BFloat16* const* in, c10::BFloat16* const* out, const float* c, const float* s, int64_t half) {
  using Vec = Vectorized<float>;
  constexpr int64_t L = Vec::size();  // words per vector
  constexpr int U = NT ? kPerLine<4 * L> : 1;  // stores of 2L elements per streamed line
  int64_t j = 0;
  for (; j + 2 * L * U <= half; j += 2 * L * U) {
    std::pair<Vec, Vec> cs[U], ss[U];  // (even, odd) pairs
    for (int u = 0; u < U; ++u) {
      const int64_t e = j + 2 * L * u;
      cs[u] = at::vec::deinterleave2(Vec::loadu(c + e), Vec::loadu(c + e + L));
      ss[u] = at::vec::deinterleave2(Vec::loadu(s + e), Vec::loadu(s + e + L));
    }
    for (int h = 0; h < M; ++h) {
      decltype(bf16_words(Vec(), Vec())) lo[U], hi[U];
      for (int u = 0; u < U; ++u) {
        const int64_t e = j + 2 * L * u;
        const auto& [c0, c1] = cs[u];
        const auto& [s0, s1] = ss[u];
        Vec a0, a1, b0, b1;
        bf16_members(in[h] + e, a0, a1);
        bf16_members(in[h] + half + e, b0, b1);
        lo[u] = bf16_words(a0 * c0 - b0 * s0, a1 * c1 - b1 * s1);
        hi[u] = bf16_words(a0 * s0 + b0 * c0, a1 * s1 + b1 * c1);
      }
      for (int u = 0; u < U; ++u) put<NT>(out[h] + j + 2 * L * u, lo[u]);  // a line of the first half,
      for (int u = 0; u < U; ++u) put<NT>(out[h] + half + j + 2 * L * u, hi[u]);  // then of the second
    }
  }
  return j;
}
#endif

// Token t of heads [h0, h0 + M), contiguous vectors.
template <bool NT, int M, typename scalar_t>
inline void rotate_block(const Run<scalar_t>& r, int64_t t, int64_t h0, int64_t dim, bool interleaved) {
  using acc_t = typename Run<scalar_t>::acc_t;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const scalar_t* in[M];
  scalar_t* out[M];
  for (int h = 0; h < M; ++h) {
    in[h] = r.in + t * r.in_tok + (h0 + h) * r.in_head;
    out[h] = r.out + t * r.out_tok + (h0 + h) * r.out_head;
  }
  const acc_t* c = r.coef + t * r.coef_tok;
  const int64_t half = dim / 2;
  const PairsOf<acc_t> cs = pairs_of<scalar_t>(c, dim, interleaved);
  constexpr int U = NT ? kPerLine<L * int64_t(sizeof(scalar_t))> : 1;  // vectors per streamed line
  int64_t j = 0;  // pairs rotated
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (kPairWords<scalar_t>) {
    j = interleaved ? rotate_bf16_pairs<NT, M>(in, out, c, cs.s, half)
                    : rotate_bf16_halves<NT, M>(in, out, c, cs.s, half);
  }
#endif
  if (interleaved) {
    // Rows per element (the x86 bf16 pairs are done): U vectors (a line of
    // output) per head at a time, then one at a time.
    if constexpr (!kPairWords<scalar_t>) {
      const acc_t* s = c + dim;
      const int64_t end = dim - dim % L;
      int64_t i = 2 * j;
      const auto vectors = [&](auto n, int64_t e) {
        constexpr int N = decltype(n)::value;
        Vec ci[N], si[N];
        for (int u = 0; u < N; ++u) ci[u] = Vec::loadu(c + e + u * L), si[u] = Vec::loadu(s + e + u * L);
        for (int h = 0; h < M; ++h) {
          for (int u = 0; u < N; ++u) {
            const Vec x = load<scalar_t, acc_t>(in[h] + e + u * L);
            store<NT>(out[h] + e + u * L, x * ci[u] + swap_pairs(x) * si[u]);
          }
        }
      };
      for (; i + U * L <= end; i += U * L) vectors(std::integral_constant<int, U>{}, i);
      for (; i < end; i += L) vectors(std::integral_constant<int, 1>{}, i);
      j = i / 2;
    }
  } else {
    // U pairs of vectors per head at a time (a line of each half), then one.
    const acc_t* s = cs.s;
    const int64_t end = half - half % L;
    const auto vectors = [&](auto n, int64_t k) {
      constexpr int N = decltype(n)::value;
      Vec ci[N], si[N];
      for (int u = 0; u < N; ++u) ci[u] = Vec::loadu(c + k + u * L), si[u] = Vec::loadu(s + k + u * L);
      for (int h = 0; h < M; ++h) {
        Vec lo[N], hi[N];
        for (int u = 0; u < N; ++u) {
          const Vec x0 = load<scalar_t, acc_t>(in[h] + k + u * L);
          const Vec x1 = load<scalar_t, acc_t>(in[h] + half + k + u * L);
          lo[u] = x0 * ci[u] - x1 * si[u];
          hi[u] = x0 * si[u] + x1 * ci[u];
        }
        for (int u = 0; u < N; ++u) store<NT>(out[h] + k + u * L, lo[u]);
        for (int u = 0; u < N; ++u) store<NT>(out[h] + half + k + u * L, hi[u]);
      }
    };
    for (; j + U * L <= end; j += U * L) vectors(std::integral_constant<int, U>{}, j);
    for (; j < end; j += L) vectors(std::integral_constant<int, 1>{}, j);
  }
  if (j < half) {
    for (int h = 0; h < M; ++h) rotate_scalar(in[h], 1, out[h], 1, c, dim, interleaved, j);
  }
}

// Heads-major: each head of the block is one sequential stream over the
// tokens, prefetched a few tokens ahead.
template <bool NT, int M, typename scalar_t>
void rotate_heads_major(const Run<scalar_t>& r, int64_t h0, int64_t dim, bool interleaved) {
  const int64_t vec_bytes = dim * int64_t(sizeof(scalar_t));
  const bool prefetch = r.prefetch;  // read once: the stores below may alias r
  for (int64_t t = 0; t < r.tokens; ++t) {
    // Near the end of the run, the next heads' first tokens: the stream
    // goes on without a stall where the run changes heads.
    const bool wrap = t + kPrefetchVectors >= r.tokens;
    const int64_t ahead = wrap ? t + kPrefetchVectors - r.tokens : t + kPrefetchVectors;
    const int64_t hp = wrap ? h0 + M : h0;
    if (prefetch && ahead < r.tokens) {
      for (int64_t h = hp; h < hp + M && h < r.heads; ++h) {
        prefetch_lines(r.in + ahead * r.in_tok + h * r.in_head, vec_bytes);
      }
    }
    rotate_block<NT, M>(r, t, h0, dim, interleaved);
  }
}

// Token-major: token by token, a block of M heads at a time.
template <bool NT, int M, typename scalar_t>
void rotate_token_major(const Run<scalar_t>& r, int64_t dim, bool interleaved) {
  const int64_t blocked = r.heads - r.heads % M;
  const int64_t vec_bytes = dim * int64_t(sizeof(scalar_t));
  const int64_t walk_ahead = std::max<int64_t>(M, kPrefetchWalkBytes / vec_bytes);
  // Read once (the stores below may alias r): what this walk prefetches.
  const bool prefetch_in = r.prefetch && r.tokens > 1, prefetch_out = r.prefetch && !NT;
  for (int64_t t = 0; t < r.tokens; ++t) {
    for (int64_t h = 0; h < blocked; h += M) {
      // The input walk_ahead vectors on (the next block alone was too
      // near: one vector ahead for streamed 16-bit outputs), and the next
      // block's output lines for writing (their read for ownership
      // overlaps this block's work).
      if (prefetch_in) {
        int64_t pt = t, ph = h;
        walk_on(pt, ph, walk_ahead, r.heads);
        for (int64_t i = 0; i < M && pt < r.tokens; ++i, walk_on(pt, ph, 1, r.heads)) {
          prefetch_lines(r.in + pt * r.in_tok + ph * r.in_head, vec_bytes);
        }
      }
      for (int64_t n = h + M; prefetch_out && n < h + 2 * M && n < r.heads; ++n) {
        prefetch_lines<true>(r.out + t * r.out_tok + n * r.out_head, vec_bytes);
      }
      rotate_block<NT, M>(r, t, h, dim, interleaved);
    }
    for (int64_t h = blocked; h < r.heads; ++h) rotate_block<NT, 1>(r, t, h, dim, interleaved);
  }
}

template <bool NT, typename scalar_t>
void rotate_contiguous(const Run<scalar_t>& r, int64_t dim, bool interleaved) {
  // A streamed line flushed half-written costs a read of the line, so each
  // head writes whole lines (kPerLine stores back to back) and none is left
  // open: heads-major runs keep the block of heads, whose heads share each
  // load of the coefficients. A token's heads are adjacent: streamed one at
  // a time they are one sequential stream, which 4- and 8-byte elements
  // take (fp32, HF layout, Zen 5: 0.89-1.04x `clone`, against 0.98-1.33x
  // with the block). 16-bit ones keep the block, whose heads share each
  // load of the coefficients (and rotate_half's deinterleave of them; bf16:
  // medians 1.17-1.29x against 1.29-1.38x).
  constexpr int M = kHeadBlock;
  constexpr int kStreamedTokenMajor = sizeof(scalar_t) >= 4 ? 1 : M;
  if (r.tokens_outer) return rotate_token_major<NT, NT ? kStreamedTokenMajor : M>(r, dim, interleaved);
  const int64_t blocked = r.heads - r.heads % M;
  for (int64_t h = 0; h < blocked; h += M) rotate_heads_major<NT, M>(r, h, dim, interleaved);
  for (int64_t h = blocked; h < r.heads; ++h) rotate_heads_major<NT, 1>(r, h, dim, interleaved);
}

}  // namespace

template <typename scalar_t>
void rotate_run(const Run<scalar_t>& r, int64_t dim, bool interleaved, bool nt) {
  if (r.in_inner != 1 || r.out_inner != 1) {
    for (int64_t t = 0; t < r.tokens; ++t) {
      for (int64_t h = 0; h < r.heads; ++h) {
        rotate_scalar(
            r.in + t * r.in_tok + h * r.in_head, r.in_inner, r.out + t * r.out_tok + h * r.out_head, r.out_inner,
            r.coef + t * r.coef_tok, dim, interleaved, 0);
      }
    }
    return;
  }
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if (nt) {
    rotate_contiguous<true>(r, dim, interleaved);
    stream_fence();
    return;
  }
#endif
  rotate_contiguous<false>(r, dim, interleaved);
}

template <typename scalar_t>
bool interleaved_pair_rows() {
  return kPairWords<scalar_t>;
}

template bool interleaved_pair_rows<float>();
template bool interleaved_pair_rows<double>();
template bool interleaved_pair_rows<c10::Half>();
template bool interleaved_pair_rows<c10::BFloat16>();
template void rotate_run<float>(const Run<float>&, int64_t, bool, bool);
template void rotate_run<double>(const Run<double>&, int64_t, bool, bool);
template void rotate_run<c10::Half>(const Run<c10::Half>&, int64_t, bool, bool);
template void rotate_run<c10::BFloat16>(const Run<c10::BFloat16>&, int64_t, bool, bool);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace rotary
