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
inline Vec fma(Vec w, __m512 x, Vec acc) { return {_mm512_fmadd_ps(w.v, x, acc.v)}; }
inline __m512 broadcast(float x) { return _mm512_set1_ps(x); }
using Scalar = __m512;
const char* const KERNEL = "avx512";
}  // namespace
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
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
inline Vec fma(Vec w, __m256 x, Vec acc) { return {_mm256_fmadd_ps(w.lo, x, acc.lo), _mm256_fmadd_ps(w.hi, x, acc.hi)}; }
inline __m256 broadcast(float x) { return _mm256_set1_ps(x); }
using Scalar = __m256;
const char* const KERNEL = "avx2";
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
  Vec acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = load(sums + (r * G + g) * 16);
  for (int64_t k = k0; k < k1; ++k) {
    if (k - k0 < lines)
      for (int i = 0; i < ahead; ++i) _mm_prefetch(next[i] + (k - k0) * 16 * sizeof(W), _MM_HINT_T1);
    Vec wv[G];
    for (int g = 0; g < G; ++g) wv[g] = load(w + g * block + k * 16);
    for (int r = 0; r < R; ++r) {
      const Scalar xv = broadcast(x[r * in + k]);
      for (int g = 0; g < G; ++g) acc[r][g] = fma(wv[g], xv, acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) store(sums + (r * G + g) * 16, acc[r][g]);
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

// Quantized GGUF weights (`quant_pack`'s layout, [out / 16][in / 32][superblock]): per 16 outputs and 32 inputs
// one superblock holding the 16 outputs' float16 scales (Q4_1: then their float16 minimums), then the 32 inputs'
// quants, input-major, 16 outputs side by side (Q8_0: one signed byte each; Q4_0/Q4_1: two inputs per byte, the
// even input in the low nibble). A superblock dequantizes to exactly the float32 values GGUF's reference
// dequantization gives (Q8_0 d*q, Q4_0 d*(q-8), Q4_1 d*q+m: one rounding at most, the same one), so a product over
// it equals `rows_linear` over the dequantized float32 weight bit for bit, with a quarter to an eighth of the reads.
enum class Quant { Q8_0, Q4_0, Q4_1 };
template <Quant F>
struct Format;
template <>
struct Format<Quant::Q8_0> {
  static constexpr int64_t HEAD = 32, BYTES = HEAD + 512;
};
template <>
struct Format<Quant::Q4_0> {
  static constexpr int64_t HEAD = 32, BYTES = HEAD + 256;
};
template <>
struct Format<Quant::Q4_1> {
  static constexpr int64_t HEAD = 64, BYTES = HEAD + 256;
};

#if defined(__AVX512F__)
inline Vec half16(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline Vec quant_value(__m512i q, Vec d, Vec off) { return {_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d.v, off.v)}; }
inline Vec times(Vec a, float b) { return {_mm512_mul_ps(a.v, _mm512_set1_ps(b))}; }
// Input k's 16 signed bytes (Q8_0) times the scales.
inline Vec q8_values(const uint8_t* p, Vec d) {
  const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_mul_ps(_mm512_cvtepi32_ps(q), d.v)};
}
// Two inputs' 16 nibble pairs: the even input's values, then the odd one's.
inline void q4_values(const uint8_t* p, Vec d, Vec off, Vec& even, Vec& odd) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  even = quant_value(_mm512_and_si512(b, _mm512_set1_epi32(15)), d, off);
  odd = quant_value(_mm512_srli_epi32(b, 4), d, off);
}
#else
inline Vec half16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline __m256i bytes8(const uint8_t* p, bool is_signed) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}
inline __m256 quant8(__m256i q, __m256 d, __m256 off) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, off); }
inline Vec times(Vec a, float b) { return {_mm256_mul_ps(a.lo, _mm256_set1_ps(b)), _mm256_mul_ps(a.hi, _mm256_set1_ps(b))}; }
inline Vec q8_values(const uint8_t* p, Vec d) {
  return {_mm256_mul_ps(_mm256_cvtepi32_ps(bytes8(p, true)), d.lo),
          _mm256_mul_ps(_mm256_cvtepi32_ps(bytes8(p + 8, true)), d.hi)};
}
inline void q4_values(const uint8_t* p, Vec d, Vec off, Vec& even, Vec& odd) {
  const __m256i lo = bytes8(p, false), hi = bytes8(p + 8, false), mask = _mm256_set1_epi32(15);
  even = {quant8(_mm256_and_si256(lo, mask), d.lo, off.lo), quant8(_mm256_and_si256(hi, mask), d.hi, off.hi)};
  odd = {quant8(_mm256_srli_epi32(lo, 4), d.lo, off.lo), quant8(_mm256_srli_epi32(hi, 4), d.hi, off.hi)};
}
#endif

// One superblock's 32 x 16 weights, dequantized exactly into ``dst`` (input-major, 16 outputs per input).
template <Quant F>
inline void dequantize(const uint8_t* sb, float* dst) {
  const Vec d = half16(sb);
  const uint8_t* q = sb + Format<F>::HEAD;
  if constexpr (F == Quant::Q8_0) {
    for (int k = 0; k < 32; ++k) store(dst + k * 16, q8_values(q + k * 16, d));
  } else {
    const Vec off = F == Quant::Q4_0 ? times(d, -8.0f) : half16(sb + 32);  // d*q - 8d = d*(q-8), exact
    for (int p = 0; p < 16; ++p) {
      Vec even, odd;
      q4_values(q + p * 16, d, off, even, odd);
      store(dst + p * 32, even);
      store(dst + p * 32 + 16, odd);
    }
  }
}

// `rows_group` over quantized weights (``block`` bytes apart): each slice of the group's superblocks dequantized
// once into an L1 buffer (while the next slice is fetched) that every chunk of rows reads as float32: the same
// exact values, so every sum is the one `rows_group` computes over the dequantized float32 weight.
template <int G, Quant F>
void quant_group(const float* x, int64_t n, int64_t in, const uint8_t* w, int64_t block, float* sums) {
  constexpr int64_t cols = G * 16, span = SLICE * 16, bytes = Format<F>::BYTES;
  std::fill(sums, sums + n * cols, 0.0f);
  alignas(64) float buf[G * span];
  for (int64_t k0 = 0; k0 < in; k0 += SLICE) {
    const int64_t k1 = std::min(in, k0 + SLICE), len = k1 - k0;
    for (int g = 0; g < G; ++g) {
      const uint8_t* src = w + g * block + k0 / 32 * bytes;
      if (k1 < in)
        for (int64_t i = 0; i < SLICE / 32 * bytes; i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(src + len / 32 * bytes + i), _MM_HINT_T0);
      for (int64_t s = 0; s < len / 32; ++s) dequantize<F>(src + s * bytes, buf + g * span + s * 512);
    }
    int64_t r = 0;
    for (; r + CHUNK <= n; r += CHUNK) rows_chunk<CHUNK, G, float>(x + r * in + k0, in, buf, span, 0, len, sums + r * cols);
    if (r < n) rows_tail<CHUNK - 1, G, float>(x + r * in + k0, n - r, in, buf, span, 0, len, sums + r * cols);
  }
}

// The sums of ``n`` rows over G blocks plus the bias, stored as O (float32, or bfloat16 rounded to nearest even).
template <typename O>
void store_sums(int64_t n, int64_t cols, const float* sums, const float* bias, O* out, int64_t stride, int64_t col) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < cols; ++j)
      out[r * stride + col + j] = static_cast<O>(sums[r * cols + j] + (bias ? bias[col + j] : 0.0f));
}

// Every block of a weight over ``n`` rows into ``out`` (O): the blocks split in groups over the threads, and
// ``group(G, b, sums)`` (G an std::integral_constant) filling the sums [n][G * 16] of the G blocks from block b.
template <typename O, typename Group>
void blocks_all(int64_t n, int64_t blocks, const float* bp, O* op, const Group& group) {
  const int64_t out = blocks * 16;
  at::parallel_for(0, blocks, GROUP, [&](int64_t b0, int64_t b1) {
    std::vector<float> sums(n * GROUP * 16);
    for (int64_t b = b0; b < b1; b += GROUP) {
      const int64_t width = std::min<int64_t>(GROUP, b1 - b);
      if (width == GROUP) group(std::integral_constant<int, GROUP>{}, b, sums.data());
      else if (width == 3) group(std::integral_constant<int, 3>{}, b, sums.data());
      else if (width == 2) group(std::integral_constant<int, 2>{}, b, sums.data());
      else group(std::integral_constant<int, 1>{}, b, sums.data());
      store_sums<O>(n, width * 16, sums.data(), bp, op, out, b * 16);
    }
  });
}

// Every block of a packed weight (``W``: float or bfloat16 bits) over ``n`` float32 rows into ``out`` (O).
template <typename W, typename O>
void rows_all(const float* xp, int64_t n, int64_t in, const W* wp, int64_t blocks, const float* bp, O* op) {
  const int64_t block = in * 16;
  blocks_all<O>(n, blocks, bp, op, [&](auto width, int64_t b, float* sums) {
    constexpr int G = decltype(width)::value;
    if constexpr (std::is_same_v<W, uint16_t>) {
      if (n > CHUNK) return rows_group_widened<G>(xp, n, in, wp + b * block, block, sums);
    }
    rows_group<G, W>(xp, n, in, wp + b * block, block, sums);
  });
}

// Every block of a `quant_pack`ed weight (format F) over ``n`` float32 rows into float32 ``out``.
template <Quant F>
void quant_all(const float* xp, int64_t n, int64_t in, const uint8_t* wp, int64_t blocks, const float* bp, float* op) {
  const int64_t block = in / 32 * Format<F>::BYTES;
  blocks_all<float>(n, blocks, bp, op, [&](auto width, int64_t b, float* sums) {
    quant_group<decltype(width)::value, F>(xp, n, in, wp + b * block, block, sums);
  });
}

}  // namespace
#endif  // LATTICE_ROWS

std::string rows_linear_kernel() {
#ifdef LATTICE_ROWS
  return KERNEL;
#else
  return "";
#endif
}

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
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  torch::Tensor result = torch::empty(shape, x.options());
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

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(!rows_linear_kernel().empty(), "quant_linear: this build has neither AVX512F nor AVX2 with FMA");
  check_cpu(packed, "quant_linear", "packed");
  TORCH_CHECK(quant_packed(packed), "quant_linear: the weight must be quant_pack's layout (uint8 [out/16, in/32, ",
              "544 | 288 | 320])");
  TORCH_CHECK(x.defined() && x.device().is_cpu(), "quant_linear: x must be a CPU tensor");
  const int64_t blocks = packed.size(0), in = packed.size(1) * 32, out = blocks * 16;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "quant_linear: float32 input expected, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "quant_linear: input of ", x.size(-1), " features, the weight takes ",
              in);
  TORCH_CHECK(!bias.has_value() || (bias->device().is_cpu() && bias->numel() == out &&
                                    bias->scalar_type() == torch::kFloat32),
              "quant_linear: a float32 CPU bias of ", out, " values expected");
  const torch::Tensor rows_in = x.reshape({-1, in}).contiguous();
  const int64_t n = rows_in.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  torch::Tensor result = torch::empty(shape, x.options());
#ifdef LATTICE_ROWS
  if (n == 0) return result;
  const torch::Tensor bc = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = bias.has_value() ? bc.data_ptr<float>() : nullptr;
  const float* xp = rows_in.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = result.data_ptr<float>();
  switch (packed.size(2)) {
    case Format<Quant::Q8_0>::BYTES: quant_all<Quant::Q8_0>(xp, n, in, wp, blocks, bp, op); break;
    case Format<Quant::Q4_0>::BYTES: quant_all<Quant::Q4_0>(xp, n, in, wp, blocks, bp, op); break;
    default: quant_all<Quant::Q4_1>(xp, n, in, wp, blocks, bp, op);
  }
#endif
  return result;
}
