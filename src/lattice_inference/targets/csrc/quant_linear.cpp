// Linear layers over GGUF-quantized weights (Q8_0, Q4_0, Q4_1) kept in their blocks, on integer dot products.
//
// Why: people who run models on CPUs keep them quantized, and at the sizes they run a decode step is a read of the
// weights: a Q4_0 file is an eighth of float32's bytes. Dequantizing every weight to float32 as it is read costs
// about a third of an instruction per weight, more than the memory does; integer dot products of the weight's
// quants with the row's quantized inputs (what llama.cpp computes) cost a tenth of that.
//
// What each row computes, one fixed sequence whichever rows come with it:
// 1. its inputs quantized per block of 32 to signed bytes: amax = max |x|, d = amax / 127, q = x * (1 / d) rounded to
//    nearest even, s = sum of q (llama.cpp's Q8_0 activations, d kept in float32);
// 2. per output and block, the integer dot of the weight's quants with the row's (Q4_0: quants minus 8), exact
//    (however computed: VNNI dot products, pairwise multiply-adds that cannot saturate on these ranges, offsets);
// 3. per output, over the blocks in input order: acc = fma(d_w * d_x, dot, acc), for Q4_1 then also
//    acc = fma(m_w, d_x * s, acc); the bias added last.
// The dots are exact integers, so how they are computed (AVX512-VNNI dot products, or pairwise multiply-adds,
// which cannot saturate on these ranges) changes no bit; the float steps run lane-wise, one output per lane, alike in
// 8 or 16 lanes. So a k-row product equals k 1-row products bit for bit, and the AVX2 build equals the AVX512 one.
//
// Layout (`quant_pack`, uint8 [out / 16][in / 32][superblock]): per 16 outputs and 32 inputs, the outputs' float16
// scales (Q4_1: then their float16 minimums), then the quants in groups of 4 inputs, an output's 4 side by side (one
// 32-bit lane of a dot product): Q8_0 8 groups of 64 signed bytes; Q4 4 chunks of 64 bytes, chunk c holding group c
// (inputs 4c..4c+3) in its low nibbles and group c + 4 (inputs 16+4c..) in its high ones.
#include "quant_linear.h"
#include "tensor_checks.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LATTICE_QUANT 1
#include <immintrin.h>
namespace {
constexpr int ROWS = 4;  // rows per pass over a group's weights
struct VI {              // 16 outputs' int32 sums
  __m512i v;
};
struct VF {
  __m512 v;
};
inline VI izero() { return {_mm512_setzero_si512()}; }
inline VF fzero() { return {_mm512_setzero_ps()}; }
inline VI load64(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline VI bcast4(const int8_t* p) {  // 4 inputs' bytes in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return {_mm512_set1_epi32(v)};
}
inline void nibbles(const uint8_t* p, VI& lo, VI& hi) {
  const __m512i v = _mm512_loadu_si512(p), m = _mm512_set1_epi8(15);
  lo = {_mm512_and_si512(v, m)};
  hi = {_mm512_and_si512(_mm512_srli_epi16(v, 4), m)};
}
// acc + per lane the dot of 4 unsigned bytes ``w`` with 4 signed bytes ``x``
inline VI dot4(VI acc, VI w, VI x) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, w.v, x.v)};
#else
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(w.v, x.v), _mm512_set1_epi16(1)))};
#endif
}
// Signed weights (Q8_0) times signed inputs. With VNNI: the inputs offset by 128 (unsigned, a flip of the sign bit)
// times the weights, less 128 times the weights' sum (one dot product per row, the sum shared by the rows).
// Without: |w| times x with w's sign (|w| <= 128 and |x| <= 127: no pair sum saturates).
#if defined(__AVX512VNNI__)
struct Signed {
  __m512i w;
};
inline Signed signed_weights(VI w) { return {w.v}; }
inline VI q8_input(VI x) { return {_mm512_xor_si512(x.v, _mm512_set1_epi8(-128))}; }
inline VI q8_weight_sum(VI sum, const Signed& w) { return {_mm512_dpbusd_epi32(sum.v, _mm512_set1_epi8(1), w.w)}; }
inline VI dot4_signed(VI acc, const Signed& w, VI x) { return {_mm512_dpbusd_epi32(acc.v, x.v, w.w)}; }
inline VI q8_correct(VI dot, VI sum) { return {_mm512_sub_epi32(dot.v, _mm512_slli_epi32(sum.v, 7))}; }
#else
struct Signed {
  __m512i abs;
  __mmask64 negative;
};
inline Signed signed_weights(VI w) { return {_mm512_abs_epi8(w.v), _mm512_movepi8_mask(w.v)}; }
inline VI q8_input(VI x) { return x; }
inline VI q8_weight_sum(VI sum, const Signed&) { return sum; }
inline VI dot4_signed(VI acc, const Signed& w, VI x) {
  return dot4(acc, {w.abs}, {_mm512_mask_sub_epi8(x.v, w.negative, _mm512_setzero_si512(), x.v)});
}
inline VI q8_correct(VI dot, VI) { return dot; }
#endif
inline VI minus(VI a, int32_t b) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(b))}; }
inline VF half16(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline VF scaled(VF d, float dx) { return {_mm512_mul_ps(d.v, _mm512_set1_ps(dx))}; }
inline VF fma_int(VF a, VI b, VF acc) { return {_mm512_fmadd_ps(a.v, _mm512_cvtepi32_ps(b.v), acc.v)}; }
inline VF fma_scalar(VF a, float b, VF acc) { return {_mm512_fmadd_ps(a.v, _mm512_set1_ps(b), acc.v)}; }
inline void store(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
#if defined(__AVX512VNNI__)
const char* const KERNEL = "avx512_vnni";
#else
const char* const KERNEL = "avx512";
#endif
}  // namespace
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LATTICE_QUANT 1
#include <immintrin.h>
namespace {
constexpr int ROWS = 2;
struct VI {  // outputs 0-7, 8-15
  __m256i lo, hi;
};
struct VF {
  __m256 lo, hi;
};
inline VI izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline VF fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VI load64(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline VI bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  const __m256i b = _mm256_set1_epi32(v);
  return {b, b};
}
inline void nibbles(const uint8_t* p, VI& lo, VI& hi) {
  const VI v = load64(p);
  const __m256i m = _mm256_set1_epi8(15);
  lo = {_mm256_and_si256(v.lo, m), _mm256_and_si256(v.hi, m)};
  hi = {_mm256_and_si256(_mm256_srli_epi16(v.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.hi, 4), m)};
}
inline __m256i dot4_half(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
inline VI dot4(VI acc, VI w, VI x) { return {dot4_half(acc.lo, w.lo, x.lo), dot4_half(acc.hi, w.hi, x.hi)}; }
struct Signed {
  VI w;
};
inline Signed signed_weights(VI w) { return {w}; }
inline VI q8_input(VI x) { return x; }
inline VI q8_weight_sum(VI sum, const Signed&) { return sum; }
inline VI q8_correct(VI dot, VI) { return dot; }
inline VI dot4_signed(VI acc, const Signed& s, VI x) {
  const VI w = s.w;
  return {dot4_half(acc.lo, _mm256_sign_epi8(w.lo, w.lo), _mm256_sign_epi8(x.lo, w.lo)),
          dot4_half(acc.hi, _mm256_sign_epi8(w.hi, w.hi), _mm256_sign_epi8(x.hi, w.hi))};
}
inline VI minus(VI a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
}
inline VF half16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline VF scaled(VF d, float dx) {
  const __m256 v = _mm256_set1_ps(dx);
  return {_mm256_mul_ps(d.lo, v), _mm256_mul_ps(d.hi, v)};
}
inline VF fma_int(VF a, VI b, VF acc) {
  return {_mm256_fmadd_ps(a.lo, _mm256_cvtepi32_ps(b.lo), acc.lo), _mm256_fmadd_ps(a.hi, _mm256_cvtepi32_ps(b.hi), acc.hi)};
}
inline VF fma_scalar(VF a, float b, VF acc) {
  const __m256 v = _mm256_set1_ps(b);
  return {_mm256_fmadd_ps(a.lo, v, acc.lo), _mm256_fmadd_ps(a.hi, v, acc.hi)};
}
inline void store(float* p, VF a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
const char* const KERNEL = "avx2";
}  // namespace
#endif

#ifdef LATTICE_QUANT
namespace {

constexpr int GROUP = 2;      // blocks of 16 outputs per pass (weight streams per thread)
constexpr int64_t AHEAD = 4;  // superblocks fetched ahead of the one being read

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

// Rows quantized per block of 32 inputs (step 1 of the file comment).
struct QuantRows {
  int64_t in = 0, blocks = 0;
  std::vector<int8_t> q;   // [n][in]
  std::vector<float> d;    // [n][blocks]
  std::vector<int32_t> s;  // [n][blocks]
  std::vector<float> ds;   // d * s
};

// One block of 32 inputs quantized (step 1 of the file comment), 8 lanes at a time (both builds have AVX2): the
// largest |v| (a NaN input never wins: `max_ps` returns its second operand then), d = amax / 127, each q = v * (1 / d)
// rounded to nearest even (the default rounding mode, as `nearbyint`), 0 where that is NaN; s = the sum of the q.
// Every step is the scalar one, lane by lane, so the bits do not depend on the vector width.
inline void quantize_block(const float* v, int8_t* q, float& d, int32_t& s) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 x[4], top = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    x[k] = _mm256_loadu_ps(v + 8 * k);
    top = _mm256_max_ps(_mm256_and_ps(x[k], magnitude), top);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  float amax = 0.0f;
  for (float lane : lanes) amax = std::max(amax, lane);
  d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  __m256i qi[4], sum = _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k) {
    const __m256 t = _mm256_mul_ps(x[k], id);
    const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(t, t, _CMP_ORD_Q));
    qi[k] = _mm256_and_si256(_mm256_cvtps_epi32(t), ordered);
    sum = _mm256_add_epi32(sum, qi[k]);
  }
  // int32 -> int8 (all within -127..127): the packs interleave 128-bit lanes, the permute puts them back in order
  const __m256i words = _mm256_packs_epi32(qi[0], qi[1]), words2 = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  int32_t parts[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts), sum);
  s = 0;
  for (int32_t part : parts) s += part;
}

QuantRows quantize_rows(const float* x, int64_t n, int64_t in) {
  QuantRows rows;
  rows.in = in;
  rows.blocks = in / 32;
  rows.q.resize(n * in);
  rows.d.resize(n * rows.blocks);
  rows.s.resize(n * rows.blocks);
  rows.ds.resize(n * rows.blocks);
  at::parallel_for(0, n * rows.blocks, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      quantize_block(x + i * 32, rows.q.data() + i * 32, rows.d[i], rows.s[i]);
      rows.ds[i] = rows.d[i] * static_cast<float>(rows.s[i]);
    }
  });
  return rows;
}

// R rows (from ``r0``) times G blocks of weights (``block`` bytes apart) into ``out`` [R][stride] from column
// ``col``, plus the bias: steps 2 and 3 of the file comment, each output's blocks in input order.
template <Quant F, int R, int G>
void quant_pass(const QuantRows& xq, int64_t r0, const uint8_t* w, int64_t block, const float* bias, float* out,
                int64_t stride, int64_t col) {
  constexpr int64_t head = Format<F>::HEAD, bytes = Format<F>::BYTES;
  const int64_t in = xq.in, nb = xq.blocks;
  VF acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sb[G];
    for (int g = 0; g < G; ++g) {
      sb[g] = w + g * block + b * bytes;
      if (b + AHEAD < nb)
        for (int64_t line = 0; line < bytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(sb[g] + AHEAD * bytes + line), _MM_HINT_T0);
    }
    const int8_t* xb = xq.q.data() + r0 * in + b * 32;
    VI dot[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) dot[r][g] = izero();
    if constexpr (F == Quant::Q8_0) {
      VI sums[G];
      for (int g = 0; g < G; ++g) sums[g] = izero();
      for (int j = 0; j < 8; ++j) {
        VI x4[R];
        for (int r = 0; r < R; ++r) x4[r] = q8_input(bcast4(xb + r * in + 4 * j));
        for (int g = 0; g < G; ++g) {
          const Signed wv = signed_weights(load64(sb[g] + head + 64 * j));
          sums[g] = q8_weight_sum(sums[g], wv);
          for (int r = 0; r < R; ++r) dot[r][g] = dot4_signed(dot[r][g], wv, x4[r]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) dot[r][g] = q8_correct(dot[r][g], sums[g]);
    } else {
      for (int c = 0; c < 4; ++c) {
        VI xlo[R], xhi[R];
        for (int r = 0; r < R; ++r) {
          xlo[r] = bcast4(xb + r * in + 4 * c);
          xhi[r] = bcast4(xb + r * in + 16 + 4 * c);
        }
        for (int g = 0; g < G; ++g) {
          VI lo, hi;
          nibbles(sb[g] + head + 64 * c, lo, hi);
          for (int r = 0; r < R; ++r) dot[r][g] = dot4(dot4(dot[r][g], lo, xlo[r]), hi, xhi[r]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const VF dw = half16(sb[g]), mw = F == Quant::Q4_1 ? half16(sb[g] + 32) : dw;
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        const VI sum = F == Quant::Q4_0 ? minus(dot[r][g], 8 * xq.s[i]) : dot[r][g];  // quants minus 8
        acc[r][g] = fma_int(scaled(dw, xq.d[i]), sum, acc[r][g]);
        if constexpr (F == Quant::Q4_1) acc[r][g] = fma_scalar(mw, xq.ds[i], acc[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      float* o = out + r * stride + col + g * 16;
      store(o, acc[r][g]);
      if (bias)
        for (int j = 0; j < 16; ++j) o[j] += bias[col + g * 16 + j];
    }
}

template <Quant F, int R, int G>
void quant_tail(const QuantRows& xq, int64_t r0, int64_t rows, const uint8_t* w, int64_t block, const float* bias,
                float* out, int64_t stride, int64_t col) {
  if constexpr (R > 0) {
    if (rows == R) return quant_pass<F, R, G>(xq, r0, w, block, bias, out, stride, col);
    quant_tail<F, R - 1, G>(xq, r0, rows, w, block, bias, out, stride, col);
  }
}

// All ``n`` rows times G blocks from block ``b``, ROWS rows a pass.
template <Quant F, int G>
void quant_group(const QuantRows& xq, int64_t n, const uint8_t* w, int64_t block, const float* bias, float* out,
                 int64_t stride, int64_t col) {
  int64_t r = 0;
  for (; r + ROWS <= n; r += ROWS)
    quant_pass<F, ROWS, G>(xq, r, w, block, bias, out + r * stride, stride, col);
  if (r < n) quant_tail<F, ROWS - 1, G>(xq, r, n - r, w, block, bias, out + r * stride, stride, col);
}

template <Quant F>
void quant_all(const QuantRows& xq, int64_t n, const uint8_t* wp, int64_t blocks, const float* bias, float* out) {
  const int64_t block = xq.blocks * Format<F>::BYTES, stride = blocks * 16;
  at::parallel_for(0, blocks, GROUP, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b += GROUP) {
      if (b + GROUP <= b1) quant_group<F, GROUP>(xq, n, wp + b * block, block, bias, out, stride, b * 16);
      else quant_group<F, 1>(xq, n, wp + b * block, block, bias, out, stride, b * 16);
    }
  });
}

}  // namespace
#endif  // LATTICE_QUANT

std::string quant_linear_kernel() {
#ifdef LATTICE_QUANT
  return KERNEL;
#else
  return "";
#endif
}

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(!quant_linear_kernel().empty(), "quant_linear: this build has neither AVX512BW nor AVX2 with FMA");
  check_cpu(packed, "quant_linear", "packed");
  TORCH_CHECK(quant_packed(packed),
              "quant_linear: the weight must be quant_pack's layout (uint8 [out/16, in/32, 544 | 288 | 320])");
  TORCH_CHECK(x.defined() && x.device().is_cpu(), "quant_linear: x must be a CPU tensor");
  const int64_t blocks = packed.size(0), in = packed.size(1) * 32, out = blocks * 16;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "quant_linear: float32 input expected, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "quant_linear: input of ", x.size(-1), " features, the weight takes ",
              in);
  TORCH_CHECK(!bias.has_value() ||
                  (bias->device().is_cpu() && bias->numel() == out && bias->scalar_type() == torch::kFloat32),
              "quant_linear: a float32 CPU bias of ", out, " values expected");
  const torch::Tensor rows_in = x.reshape({-1, in}).contiguous();
  const int64_t n = rows_in.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  torch::Tensor result = torch::empty(shape, x.options());
#ifdef LATTICE_QUANT
  if (n == 0) return result;
  const torch::Tensor bc = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = bias.has_value() ? bc.data_ptr<float>() : nullptr;
  const QuantRows xq = quantize_rows(rows_in.data_ptr<float>(), n, in);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = result.data_ptr<float>();
  switch (packed.size(2)) {
    case Format<Quant::Q8_0>::BYTES: quant_all<Quant::Q8_0>(xq, n, wp, blocks, bp, op); break;
    case Format<Quant::Q4_0>::BYTES: quant_all<Quant::Q4_0>(xq, n, wp, blocks, bp, op); break;
    default: quant_all<Quant::Q4_1>(xq, n, wp, blocks, bp, op);
  }
#endif
  return result;
}
