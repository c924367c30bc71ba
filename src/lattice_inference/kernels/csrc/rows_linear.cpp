// Float32 linear layers over one weight layout, every row computed by the same sequence of operations at any width.
//
// Why: oneDNN's float32 products round a row differently with the number of rows beside it, so a float32 prefill
// (all rows at once) computes other keys and values than the 1-token steps that later extend the sequence: its
// cache rows cannot be reused by the next prompt that starts with them (a conversation's next turn, an agent's next
// request), and a verification of k tokens must pad each product to a calibrated row count. Here each output of
// each row is one float32 sum over the inputs in order, one fused multiply-add each, whichever rows come with it:
// a k-row product equals k 1-row products bit for bit, so prefill rows, verified rows and 1-token rows are
// interchangeable (the native layer loop and prefix reuse then run in float32 as in bfloat16).
//
// How: the weight is laid out once as [out/16][in][16] (`rows_pack`): each input's 16 outputs of a block are one
// 64-byte vector. A call walks groups of blocks in parallel over the threads; within a group it takes the inputs
// in slices that stay in the L1 cache while every chunk of up to CHUNK rows passes over them (each loaded weight
// vector serves the chunk's rows; the sums wait in memory between slices, exactly), and from 5 rows on the first
// passes fetch the next slice. AVX512F: 16 lanes, groups of 4 blocks, chunks of 6 rows; AVX2: two 8-lane halves per
// block, groups of 2 blocks, chunks of 2 rows. How rows and blocks are grouped changes no output's sequence, and
// the two builds round alike per lane; a build with neither leaves float32 products to oneDNN.
//
// bfloat16 weights (where no bfloat16 dot-product kernel runs: AVX2-only CPUs, AVX512F without BF16) take the same
// path from their bfloat16 bytes: each weight widened exactly to float32 as it is loaded (a 16-bit shift), each row's
// inputs widened once, the same float32 fused multiply-adds, the bias added last and the sum rounded to bfloat16
// (nearest even). Half the weight reads of float32, no emulated bfloat16 arithmetic, and the same row-exactness.
#include "rows_linear.h"
#include "tensor_checks.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#define LATTICE_ROWS 1
#include <immintrin.h>
namespace {
constexpr int GROUP = 4, CHUNK = 6;
struct Vec {  // one block's 16 outputs
  __m512 v;
};
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec load(const uint16_t* p) {  // 16 bfloat16 weights, widened exactly
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
constexpr bool LANES = false;  // bfloat16 weights in the outputs' own lane order (see the AVX2 build)
inline Vec load_lanes(const uint16_t* p) { return load(p); }
inline Vec lanes(Vec a) { return a; }
inline Vec fma(Vec w, __m512 x, Vec acc) { return {_mm512_fmadd_ps(w.v, x, acc.v)}; }
inline __m512 broadcast(float x) { return _mm512_set1_ps(x); }
using Scalar = __m512;
const char* const KERNEL = "avx512";
}  // namespace
#elif defined(__AVX2__) && defined(__FMA__)
#define LATTICE_ROWS 1
#include <immintrin.h>
namespace {
constexpr int GROUP = 2, CHUNK = 2;
struct Vec {
  __m256 lo, hi;
};
inline Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec load(const uint16_t* p) { return {widen8(p), widen8(p + 8)}; }  // 16 bfloat16 weights, widened exactly
inline void store(float* p, Vec a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
// 16 bfloat16 weights widened exactly by interleaving them with zero halves: three instructions where `load` takes
// six, which bound the 1-row product over bfloat16 weights (each weight is used once per row). The outputs land in the
// lanes (0-3, 8-11 | 4-7, 12-15): `lanes` moves a block's sums between that order and the outputs' own (it is its own
// inverse). Each output keeps its one sequence of multiply-adds, so no sum changes, only the lane it runs in.
constexpr bool LANES = true;
inline Vec load_lanes(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), zero = _mm256_setzero_si256();
  return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v))};
}
inline Vec lanes(Vec a) { return {_mm256_permute2f128_ps(a.lo, a.hi, 0x20), _mm256_permute2f128_ps(a.lo, a.hi, 0x31)}; }
inline Vec fma(Vec w, __m256 x, Vec acc) { return {_mm256_fmadd_ps(w.lo, x, acc.lo), _mm256_fmadd_ps(w.hi, x, acc.hi)}; }
inline __m256 broadcast(float x) { return _mm256_set1_ps(x); }
using Scalar = __m256;
const char* const KERNEL = "avx2";
}  // namespace
#else
namespace {
const char* const KERNEL = "";  // neither: oneDNN's products run instead
}  // namespace
#endif

#ifdef LATTICE_ROWS
namespace {

constexpr int64_t SLICE = 64;  // inputs per pass: a group's 64 inputs are GROUP x 4 KiB of weights, in L1
constexpr int64_t PREFETCH_ROWS = 5;  // from this many rows the next slice is fetched while this one runs

// Adds inputs [k0, k1) of R rows ``x`` (``in`` per row) times G blocks of weights (``block`` floats apart) to
// ``sums`` [R][G * 16]: one fused multiply-add per input, row and output, each output's inputs in order. With each
// of its first ``lines`` inputs it asks for one cache line more of each of the ``ahead`` weight streams ``next``
// (into L2): prefetches change no sum.
template <int R, int G, typename W>
inline void rows_chunk(const float* x, int64_t in, const W* w, int64_t block, int64_t k0, int64_t k1,
                       float* sums, const char* const* next = nullptr, int ahead = 0, int64_t lines = 0) {
  constexpr bool permuted = LANES && std::is_same_v<W, uint16_t>;  // bfloat16 weights in `load_lanes` order
  Vec acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      acc[r][g] = load(sums + (r * G + g) * 16);
      if constexpr (permuted) acc[r][g] = lanes(acc[r][g]);
    }
  for (int64_t k = k0; k < k1; ++k) {
    if (k - k0 < lines)
      for (int i = 0; i < ahead; ++i) _mm_prefetch(next[i] + (k - k0) * 16 * sizeof(W), _MM_HINT_T1);
    Vec wv[G];
    for (int g = 0; g < G; ++g) {
      if constexpr (permuted) wv[g] = load_lanes(w + g * block + k * 16);
      else wv[g] = load(w + g * block + k * 16);
    }
    for (int r = 0; r < R; ++r) {
      const Scalar xv = broadcast(x[r * in + k]);
      for (int g = 0; g < G; ++g) acc[r][g] = fma(wv[g], xv, acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) store(sums + (r * G + g) * 16, permuted ? lanes(acc[r][g]) : acc[r][g]);
}

template <int R, int G, typename W>
inline void rows_tail(const float* x, int64_t rows, int64_t in, const W* w, int64_t block, int64_t k0,
                      int64_t k1, float* sums) {
  if constexpr (R > 0) {
    if (rows == R) return rows_chunk<R, G, W>(x, in, w, block, k0, k1, sums);
    rows_tail<R - 1, G, W>(x, rows, in, w, block, k0, k1, sums);
  }
}

// All ``n`` rows times one group of G blocks: ``sums`` [n][G * 16] (zeroed here). From `PREFETCH_ROWS` rows the
// passes over a slice are bound by the multiply-adds, not by memory, so the first passes also fetch the next slice
// of the G blocks (spread over them, one line per input and block) while they run.
template <int G, typename W>
void rows_group(const float* x, int64_t n, int64_t in, const W* w, int64_t block, float* sums) {
  constexpr int64_t cols = G * 16;
  std::fill(sums, sums + n * cols, 0.0f);
  const int64_t passes = n / CHUNK;
  for (int64_t k0 = 0; k0 < in; k0 += SLICE) {
    const int64_t k1 = std::min(in, k0 + SLICE);
    const int64_t lines = n >= PREFETCH_ROWS ? std::min(in, k1 + SLICE) - k1 : 0;  // the next slice's inputs
    int64_t r = 0;
    for (int64_t c = 0; r + CHUNK <= n; r += CHUNK, ++c) {
      const char* next[G];
      int ahead = 0;
      if (lines > 0)
        for (int64_t g = c; g < G; g += passes) next[ahead++] = reinterpret_cast<const char*>(w + g * block + k1 * 16);
      rows_chunk<CHUNK, G, W>(x + r * in, in, w, block, k0, k1, sums + r * cols, next, ahead, lines);
    }
    if (r < n) rows_tail<CHUNK - 1, G, W>(x + r * in, n - r, in, w, block, k0, k1, sums + r * cols);
  }
}

// `rows_group` over bfloat16 weights for more than one chunk of rows: each slice of the group's weights is widened
// once into an L1 buffer that every chunk then reads as float32 (while the next slice is fetched), instead of each
// chunk widening it again. The buffer holds the same exact values, so every sum is the one `rows_group` computes.
template <int G>
void rows_group_widened(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t block, float* sums) {
  constexpr int64_t cols = G * 16, span = SLICE * 16;
  std::fill(sums, sums + n * cols, 0.0f);
  alignas(64) float buf[G * span];
  for (int64_t k0 = 0; k0 < in; k0 += SLICE) {
    const int64_t k1 = std::min(in, k0 + SLICE), len = k1 - k0;
    for (int g = 0; g < G; ++g) {
      const uint16_t* src = w + g * block + k0 * 16;
      for (int64_t i = 0; i < len * 16; i += 16) {
        if (k1 < in && i % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(src + span + i), _MM_HINT_T1);
        store(buf + g * span + i, load(src + i));
      }
    }
    int64_t r = 0;
    for (; r + CHUNK <= n; r += CHUNK) rows_chunk<CHUNK, G, float>(x + r * in + k0, in, buf, span, 0, len, sums + r * cols);
    if (r < n) rows_tail<CHUNK - 1, G, float>(x + r * in + k0, n - r, in, buf, span, 0, len, sums + r * cols);
  }
}

// The group's sums plus the bias, stored as O (float32, or bfloat16 rounded to nearest even).
template <int G, typename W, typename O>
void rows_group_bias(const float* x, int64_t n, int64_t in, const W* w, int64_t block, float* sums,
                     const float* bias, O* out, int64_t stride, int64_t col) {
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (n > CHUNK) rows_group_widened<G>(x, n, in, w, block, sums);
    else rows_group<G, W>(x, n, in, w, block, sums);
  } else {
    rows_group<G, W>(x, n, in, w, block, sums);
  }
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < G * 16; ++j)
      out[r * stride + col + j] = static_cast<O>(sums[r * G * 16 + j] + (bias ? bias[col + j] : 0.0f));
}

// Every block of a packed weight (``W``: float or bfloat16 bits) over ``n`` float32 rows into ``out`` (O).
template <typename W, typename O>
void rows_all(const float* xp, int64_t n, int64_t in, const W* wp, int64_t blocks, const float* bp, O* op) {
  const int64_t block = in * 16, out = blocks * 16;
  at::parallel_for(0, blocks, GROUP, [&](int64_t b0, int64_t b1) {
    std::vector<float> sums(n * GROUP * 16);
    for (int64_t b = b0; b < b1; b += GROUP) {
      const int64_t width = std::min<int64_t>(GROUP, b1 - b);
      const W* wg = wp + b * block;
      if (width == GROUP) rows_group_bias<GROUP, W, O>(xp, n, in, wg, block, sums.data(), bp, op, out, b * 16);
      else if (width == 3) rows_group_bias<3, W, O>(xp, n, in, wg, block, sums.data(), bp, op, out, b * 16);
      else if (width == 2) rows_group_bias<2, W, O>(xp, n, in, wg, block, sums.data(), bp, op, out, b * 16);
      else rows_group_bias<1, W, O>(xp, n, in, wg, block, sums.data(), bp, op, out, b * 16);
    }
  });
}

}  // namespace
#endif  // LATTICE_ROWS

std::string rows_linear_kernel() { return KERNEL; }

torch::Tensor rows_pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.defined() && weight.device().is_cpu(), "rows_pack: the weight must be a CPU tensor");
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kBFloat16),
              "rows_pack: a 2-d float32 or bfloat16 weight");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(out % 16 == 0, "rows_pack: [out, in] = [", out, ", ", in, "], out must be a multiple of 16");
  return weight.contiguous().view({out / 16, 16, in}).permute({0, 2, 1}).contiguous();
}

torch::Tensor rows_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(!rows_linear_kernel().empty(), "rows_linear: this build has neither AVX512F nor AVX2 with FMA");
  check_cpu(packed, "rows_linear", "packed");
  TORCH_CHECK(rows_packed(packed), "rows_linear: the weight must come from rows_pack");
  TORCH_CHECK(x.defined() && x.device().is_cpu(), "rows_linear: x must be a CPU tensor");
  TORCH_CHECK(!bias.has_value() || bias->device().is_cpu(), "rows_linear: bias must be a CPU tensor");
  const int64_t blocks = packed.size(0), in = packed.size(1), out = blocks * 16;
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype, "rows_linear: ", dtype, " input expected (the weight's), got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "rows_linear: input of ", x.size(-1), " features, the weight takes ", in);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out && bias->scalar_type() == dtype),
              "rows_linear: a ", dtype, " bias of ", out, " values expected");
  // float32 rows as they are; bfloat16 rows widened once (exactly)
  const torch::Tensor rows_in = x.reshape({-1, in}).to(torch::kFloat32).contiguous();
  const int64_t n = rows_in.size(0);
  torch::Tensor result = linear_output(x, out);
#ifdef LATTICE_ROWS
  if (n == 0) return result;
  const torch::Tensor bc = bias.has_value() ? bias->to(torch::kFloat32).contiguous() : torch::Tensor();
  const float* bp = bias.has_value() ? bc.data_ptr<float>() : nullptr;
  const float* xp = rows_in.data_ptr<float>();
  if (dtype == torch::kFloat32)
    rows_all<float, float>(xp, n, in, packed.data_ptr<float>(), blocks, bp, result.data_ptr<float>());
  else
    rows_all<uint16_t, c10::BFloat16>(xp, n, in, reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                                      blocks, bp, result.data_ptr<c10::BFloat16>());
#endif
  return result;
}
