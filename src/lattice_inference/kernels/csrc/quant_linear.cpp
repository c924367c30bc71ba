// Linear layers over GGUF-quantized weights kept in their blocks, on integer dot products: Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1 (blocks of 32) and the K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256): every type of a Q4_K_M, Q5_K_M, Q6_K
// or Q8_0 file.
//
// Why: people who run models on CPUs keep them quantized, and at the sizes they run a decode step is a read of the
// weights: a Q4_0 file is an eighth of float32's bytes. Dequantizing every weight to float32 as it is read costs
// about a third of an instruction per weight, more than the memory does; integer dot products of the weight's
// quants with the row's quantized inputs (what llama.cpp computes) cost a tenth of that.
//
// What each row computes, one fixed sequence whichever rows come with it:
// 1. its inputs quantized to signed bytes as llama.cpp quantizes them for the weight's format: per block of 32
//    (Q8_0 activations): amax = max |x|, d = amax / 127, q = x * (1 / d) rounded to nearest even, s = sum of q; per
//    super-block of 256 for the K-quants (Q8_K): top = the first x of largest |x|, iscale = -127 / top, q =
//    min(127, iscale * x rounded to nearest even), d = 1 / iscale, s = the sums of each 16 q;
// 2. per output and block, the integer dot of the weight's quants with the row's, exact (however computed: VNNI dot
//    products, pairwise multiply-adds that cannot saturate on these ranges; Q4_0/Q5_0: minus 8 / 16 times s); for
//    the K-quants the sub-blocks' dots times their 6-bit (Q6_K: 8-bit signed) scales summed in int32 over the
//    super-block (Q6_K: each 16's dot less 32 times its s first), and the mins times the rows' sums likewise;
// 3. per output, over the blocks in input order: acc = fma(d_w * d_x, dot, acc), for Q4_1/Q5_1 then also
//    acc = fma(m_w, d_x * s, acc), for Q4_K/Q5_K acc = acc - (dmin_w * d_x) * mins (one fused step); the bias last.
// The dots are exact integers, so how they are computed changes no bit; the float steps run lane-wise, one output
// per lane, alike in 8 or 16 lanes. So a k-row product equals k 1-row products bit for bit, and the AVX2 build
// equals the AVX512 one.
//
// Layout (`quant_pack`, uint8 [out / 16][in / inputs][superblock]): per 16 outputs and 32 inputs (the K-quants: 256),
// the outputs' float16 scales (Q4_1, Q5_1: then their float16 minimums; Q4_K, Q5_K: d, dmin, then the sub-blocks'
// scales [8][16] and mins [8][16]; Q6_K: d, then the scales [16][16]), then the quants in groups of 4 inputs, an
// output's 4 side by side (one 32-bit lane of a dot product): Q8_0 8 groups of 64 signed bytes; the others per 32
// inputs 4 chunks of 64 bytes, chunk c holding group c (inputs 4c..4c+3) in its low nibbles and group c + 4 (inputs
// 16+4c..) in its high ones; the bits above the nibble after all the nibbles: Q5's fifth bits as 64 bytes per 32
// inputs (bit g of byte i: group g's byte i), Q6_K's two high bits as two vectors of 64 bytes (groups 0-3, 4-7).
#include "amx.h"
#include "quant_linear.h"
#include "tensor_checks.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LATTICE_QUANT 1
#include <immintrin.h>
namespace {
constexpr int ROWS = 4;     // rows per pass over a group's weights
constexpr int ROWS_Q6 = 4;  // Q6_K's
struct VI {              // 16 outputs' int32 sums
  __m512i v;
};
struct VF {
  __m512 v;
};
inline VI izero() { return {_mm512_setzero_si512()}; }
inline VF fzero() { return {_mm512_setzero_ps()}; }
inline VI load64(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline void store64(uint8_t* p, VI v) { _mm512_storeu_si512(p, v.v); }
inline VI bcast4(const int8_t* p) {  // 4 inputs' bytes in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return {_mm512_set1_epi32(v)};
}
inline VI bcast32(int32_t v) { return {_mm512_set1_epi32(v)}; }
inline VI madd16(VI a, VI b) { return {_mm512_madd_epi16(a.v, b.v)}; }  // per lane a.lo16*b.lo16 + a.hi16*b.hi16
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
// acc + the dots of ``w0`` with ``x0`` and of ``w1`` with ``x1``, for weights below 64 (every nibble format's, the
// fifth and sixth bits over them included) and inputs in [-127, 127]: a lane's two pair sums together stay within
// int16 (2 * 2 * 63 * 127 = 32,004), so without VNNI they are added as int16 and widened once. The same integers.
inline VI dot4_pair(VI acc, VI w0, VI x0, VI w1, VI x1) {
#if defined(__AVX512VNNI__)
  return dot4(dot4(acc, w0, x0), w1, x1);
#else
  const __m512i p = _mm512_add_epi16(_mm512_maddubs_epi16(w0.v, x0.v), _mm512_maddubs_epi16(w1.v, x1.v));
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))};
#endif
}
// Whether `dot4_pair_scaled` costs less than `dot4_pair` and a multiply after (without VNNI: the scale takes the
// place of the widening's ones).
#if defined(__AVX512VNNI__)
constexpr bool SCALE_IN_DOTS = false;  // the two below are then never called (named only in discarded branches)
inline VI scale_pairs(VI s) { return s; }
inline VI dot4_pair_scaled(VI acc, VI w0, VI x0, VI w1, VI x1, VI s) {
  return {_mm512_add_epi32(acc.v, _mm512_mullo_epi32(dot4_pair({_mm512_setzero_si512()}, w0, x0, w1, x1).v, s.v))};
}
#else
constexpr bool SCALE_IN_DOTS = true;
// 16 outputs' scales below 2^15 (int32 lanes) as two int16 each: what `dot4_pair_scaled` widens with
inline VI scale_pairs(VI s) { return {_mm512_or_si512(s.v, _mm512_slli_epi32(s.v, 16))}; }
// `dot4_pair` times each lane's scale ``s`` (`scale_pairs`; a K-quant's 6-bit sub-block scale), exactly: the int16
// pair sums (at most 2 * 2 * 31 * 127) times s, summed in int32.
inline VI dot4_pair_scaled(VI acc, VI w0, VI x0, VI w1, VI x1, VI s) {
  const __m512i p = _mm512_add_epi16(_mm512_maddubs_epi16(w0.v, x0.v), _mm512_maddubs_epi16(w1.v, x1.v));
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(p, s.v))};
}
#endif
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
inline VI add(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline VI mul(VI a, VI b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline VI mul(VI a, int32_t b) { return {_mm512_mullo_epi32(a.v, _mm512_set1_epi32(b))}; }
// 16 outputs' unsigned (signed) bytes widened to int32 lanes
inline VI widen_u8(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline VI widen_i8(const uint8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
// q | ((h >> shift) & mask) << 4, per byte: the high bits of 5- and 6-bit quants over their low nibbles
inline VI high_bits(VI q, VI h, int shift, int mask) {
  const __m512i bits = _mm512_and_si512(_mm512_srl_epi16(h.v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi8(mask));
  return {_mm512_or_si512(q.v, _mm512_slli_epi16(bits, 4))};
}
inline VF fnma_int(VF a, VI b, VF acc) { return {_mm512_fnmadd_ps(a.v, _mm512_cvtepi32_ps(b.v), acc.v)}; }
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
// Rows per pass over a group's weights: each pass unpacks its weights' nibbles (and the bits above them) once for
// its rows. 4 (Q6_K: 6) measured fastest on Zen 3 at 512 rows (bench/RESULTS.md, session 42), before 2.
constexpr int ROWS = 4;
constexpr int ROWS_Q6 = 6;
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
inline void store64(uint8_t* p, VI v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), v.hi);
}
inline VI bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  const __m256i b = _mm256_set1_epi32(v);
  return {b, b};
}
inline VI bcast32(int32_t v) {
  const __m256i b = _mm256_set1_epi32(v);
  return {b, b};
}
inline VI madd16(VI a, VI b) { return {_mm256_madd_epi16(a.lo, b.lo), _mm256_madd_epi16(a.hi, b.hi)}; }
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
// `dot4_pair` of the AVX-512 build: the two dots' pair sums added as int16 (weights below 64), widened once.
inline __m256i dot4_pair_half(__m256i acc, __m256i w0, __m256i x0, __m256i w1, __m256i x1) {
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
inline VI dot4_pair(VI acc, VI w0, VI x0, VI w1, VI x1) {
  return {dot4_pair_half(acc.lo, w0.lo, x0.lo, w1.lo, x1.lo), dot4_pair_half(acc.hi, w0.hi, x0.hi, w1.hi, x1.hi)};
}
// `dot4_pair_scaled` of the AVX-512 build: each lane's scale (as two int16, `scale_pairs`) widens the pair sums.
constexpr bool SCALE_IN_DOTS = true;
inline VI scale_pairs(VI s) {
  return {_mm256_or_si256(s.lo, _mm256_slli_epi32(s.lo, 16)), _mm256_or_si256(s.hi, _mm256_slli_epi32(s.hi, 16))};
}
inline __m256i dot4_pair_scaled_half(__m256i acc, __m256i w0, __m256i x0, __m256i w1, __m256i x1, __m256i s) {
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
}
inline VI dot4_pair_scaled(VI acc, VI w0, VI x0, VI w1, VI x1, VI s) {
  return {dot4_pair_scaled_half(acc.lo, w0.lo, x0.lo, w1.lo, x1.lo, s.lo),
          dot4_pair_scaled_half(acc.hi, w0.hi, x0.hi, w1.hi, x1.hi, s.hi)};
}
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
inline VI add(VI a, VI b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline VI mul(VI a, VI b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
inline VI mul(VI a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return {_mm256_mullo_epi32(a.lo, v), _mm256_mullo_epi32(a.hi, v)};
}
inline VI widen_u8(const uint8_t* p) {
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline VI widen_i8(const uint8_t* p) {
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline __m256i high_bits_half(__m256i q, __m256i h, int shift, int mask) {
  const __m256i bits = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(mask));
  return _mm256_or_si256(q, _mm256_slli_epi16(bits, 4));
}
inline VI high_bits(VI q, VI h, int shift, int mask) {
  return {high_bits_half(q.lo, h.lo, shift, mask), high_bits_half(q.hi, h.hi, shift, mask)};
}
inline VF fnma_int(VF a, VI b, VF acc) {
  return {_mm256_fnmadd_ps(a.lo, _mm256_cvtepi32_ps(b.lo), acc.lo), _mm256_fnmadd_ps(a.hi, _mm256_cvtepi32_ps(b.hi), acc.hi)};
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
#else
namespace {
const char* const KERNEL = "";  // neither: quantized weights are dequantized at load instead
}  // namespace
#endif

#ifdef LATTICE_QUANT
namespace {

constexpr int GROUP = 2;      // blocks of 16 outputs per pass (weight streams per thread)
constexpr int64_t AHEAD = 8;  // superblocks fetched ahead of the one being read

enum class Quant { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K };
// Per format: INPUTS per superblock (and per scale of the inputs: 32, or 256 for the K-quants, whose inputs are
// quantized as llama.cpp's Q8_K), the HEAD of scales before the quants, and the superblock's BYTES (16 outputs).
template <Quant F>
struct Format;
template <>
struct Format<Quant::Q8_0> {
  static constexpr int64_t INPUTS = 32, HEAD = 32, BYTES = HEAD + 512;
};
template <>
struct Format<Quant::Q4_0> {
  static constexpr int64_t INPUTS = 32, HEAD = 32, BYTES = HEAD + 256;
};
template <>
struct Format<Quant::Q4_1> {
  static constexpr int64_t INPUTS = 32, HEAD = 64, BYTES = HEAD + 256;
};
template <>
struct Format<Quant::Q5_0> {  // then 64 bytes of fifth bits: byte i, bit g = the high bit of group g's byte i
  static constexpr int64_t INPUTS = 32, HEAD = 32, BYTES = HEAD + 256 + 64;
};
template <>
struct Format<Quant::Q5_1> {
  static constexpr int64_t INPUTS = 32, HEAD = 64, BYTES = HEAD + 256 + 64;
};
template <>
struct Format<Quant::Q4_K> {  // d, dmin, scales [8][16], mins [8][16], then 8 sub-blocks' nibbles (Q4_0's layout)
  static constexpr int64_t INPUTS = 256, HEAD = 64 + 256, BYTES = HEAD + 8 * 256;
};
template <>
struct Format<Quant::Q5_K> {  // Q4_K's, then 8 sub-blocks' fifth bits (Q5_0's layout)
  static constexpr int64_t INPUTS = 256, HEAD = 64 + 256, BYTES = HEAD + 8 * 256 + 8 * 64;
};
template <>
struct Format<Quant::Q6_K> {  // d, scales [16][16] (int8), 8 parts' nibbles, 8 parts' high bit pairs (2 x 64 bytes)
  static constexpr int64_t INPUTS = 256, HEAD = 32 + 256, BYTES = HEAD + 8 * 256 + 8 * 128;
};
// The layouts above are the table's formats, in the table's order (`PACKED_FORMATS`, quant_linear.h).
template <Quant F>
constexpr bool listed() {
  const PackedFormat& f = PACKED_FORMATS[static_cast<int>(F)];
  return f.inputs == Format<F>::INPUTS && f.packed_bytes == Format<F>::BYTES;
}
static_assert(listed<Quant::Q8_0>() && listed<Quant::Q4_0>() && listed<Quant::Q4_1>() && listed<Quant::Q5_0>() &&
              listed<Quant::Q5_1>() && listed<Quant::Q4_K>() && listed<Quant::Q5_K>() && listed<Quant::Q6_K>());
template <Quant F>
constexpr bool K_QUANT = Format<F>::INPUTS == 256;

// Rows quantized per block of inputs (step 1 of the file comment): 32 (Q8_0's activations) or 256 (Q8_K's).
struct QuantRows {
  int64_t in = 0, blocks = 0, sums = 0;  // blocks and sums per row
  std::vector<int8_t> q;   // [n][in]
  std::vector<float> d;    // [n][blocks]
  std::vector<int32_t> s;  // [n][sums]: per block of 32 (Q8_0), per 16 inputs (Q8_K)
  std::vector<float> ds;   // Q8_0: d * s
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

// One block of 256 inputs quantized as llama.cpp's Q8_K (`quantize_row_q8_K_ref`): ``top`` = the first input of the
// largest |v| (NaNs never win), iscale = -127 / top, q = min(127, iscale * v rounded to nearest even), 0 where that is
// NaN; d = 1 / iscale; ``s`` the sums of each 16 q. All zero where every input is 0.
inline void quantize_block_k(const float* v, int8_t* q, float& d, int32_t* s) {
  float amax = 0.0f, top = 0.0f;
  for (int j = 0; j < 256; ++j) {
    const float a = std::fabs(v[j]);
    if (a > amax) {
      amax = a;
      top = v[j];
    }
  }
  if (amax == 0.0f) {
    std::memset(q, 0, 256);
    std::fill(s, s + 16, 0);
    d = 0.0f;
    return;
  }
  const float iscale = -127.0f / top;
  const __m256 scale = _mm256_set1_ps(iscale), most = _mm256_set1_ps(127.0f);
  for (int k = 0; k < 32; ++k) {
    const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(v + 8 * k), scale);
    const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(t, t, _CMP_ORD_Q));
    const __m256i qi = _mm256_min_epi32(_mm256_and_si256(_mm256_cvtps_epi32(t), ordered), _mm256_cvtps_epi32(most));
    int32_t lanes[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), qi);
    for (int j = 0; j < 8; ++j) q[8 * k + j] = static_cast<int8_t>(lanes[j]);
  }
  for (int g = 0; g < 16; ++g) {
    int32_t sum = 0;
    for (int j = 0; j < 16; ++j) sum += q[16 * g + j];
    s[g] = sum;
  }
  d = 1.0f / iscale;
}

QuantRows quantize_rows(const float* x, int64_t n, int64_t in, bool k_quant) {
  QuantRows rows;
  rows.in = in;
  rows.blocks = in / (k_quant ? 256 : 32);
  rows.sums = k_quant ? in / 16 : rows.blocks;
  rows.q.resize(n * in);
  rows.d.resize(n * rows.blocks);
  rows.s.resize(n * rows.sums);
  if (!k_quant) rows.ds.resize(n * rows.blocks);
  at::parallel_for(0, n * rows.blocks, k_quant ? 8 : 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (k_quant) {
        quantize_block_k(x + i * 256, rows.q.data() + i * 256, rows.d[i], rows.s.data() + i * 16);
      } else {
        quantize_block(x + i * 32, rows.q.data() + i * 32, rows.d[i], rows.s[i]);
        rows.ds[i] = rows.d[i] * static_cast<float>(rows.s[i]);
      }
    }
  });
  return rows;
}

// Chunk ``c`` of a block of 32 inputs' 4-bit quants ``quants`` (Q4_0's layout): the weights of inputs 4c..4c+3
// (``wlo``) and 16+4c.. (``whi``), one byte each; with FIFTH, Q5's fifth bits ``h0`` over them; with PAIRS, Q6_K's
// two high bits (``h0``: groups 0-3, ``h1``: 4-7).
template <bool FIFTH, bool PAIRS>
__attribute__((always_inline)) inline void chunk_weights(const uint8_t* quants, VI h0, VI h1, int c, VI& wlo, VI& whi) {
  nibbles(quants + 64 * c, wlo, whi);
  if constexpr (FIFTH) {
    wlo = high_bits(wlo, h0, c, 1);
    whi = high_bits(whi, h0, c + 4, 1);
  }
  if constexpr (PAIRS) {
    wlo = high_bits(wlo, h0, 2 * c, 3);
    whi = high_bits(whi, h1, 2 * c, 3);
  }
}

// R rows' exact integer dots with the 32 inputs of one block of quants in each of G weight blocks: 4-bit quants at
// ``quants[g]`` (Q4_0's layout; with FIFTH, Q5's fifth bits at ``highs[g]`` over them; with PAIRS, Q6_K's two high
// bits, two vectors of 64 bytes), or with SPREAD the block's weights one byte each (`spread_group`: chunk c's at
// 64c and 64(c + 4)); each row's 8 broadcasts of its inputs made once for all G blocks. ``lo`` gets the dots over
// inputs 0..15 and 16..31 both, unless SPLIT (Q6_K's sub-blocks of 16), where ``hi`` gets those over 16..31. With
// SCALED (not SPLIT) ``lo`` gets them times each block's ``scales[g]`` (`scale_pairs`).
template <int R, int G, bool FIFTH, bool PAIRS, bool SPLIT, bool SPREAD, bool SCALED = false>
__attribute__((always_inline)) inline void nibble_dots(const uint8_t* const* quants, const uint8_t* const* highs,
                                                       const int8_t* const* xb, VI (*lo)[G], VI (*hi)[G],
                                                       const VI* scales = nullptr) {
  VI h0[G], h1[G];
  for (int g = 0; g < G; ++g) {
    h0[g] = FIFTH || PAIRS ? load64(highs[g]) : izero();
    h1[g] = PAIRS ? load64(highs[g] + 64) : izero();
  }
  const auto weights = [&](int g, int c, VI& wlo, VI& whi) {
    if constexpr (SPREAD) {
      wlo = load64(quants[g] + 64 * c);
      whi = load64(quants[g] + 64 * (c + 4));
    } else {
      chunk_weights<FIFTH, PAIRS>(quants[g], h0[g], h1[g], c, wlo, whi);
    }
  };
  if constexpr (SPLIT) {  // two chunks at a time: each half's dots of chunks c and c + 1 paired
    for (int c = 0; c < 4; c += 2) {
      VI xlo[R][2], xhi[R][2];
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < 2; ++k) {
          xlo[r][k] = bcast4(xb[r] + 4 * (c + k));
          xhi[r][k] = bcast4(xb[r] + 16 + 4 * (c + k));
        }
      for (int g = 0; g < G; ++g) {
        VI wlo[2], whi[2];
        weights(g, c, wlo[0], whi[0]);
        weights(g, c + 1, wlo[1], whi[1]);
        for (int r = 0; r < R; ++r) {
          lo[r][g] = dot4_pair(lo[r][g], wlo[0], xlo[r][0], wlo[1], xlo[r][1]);
          hi[r][g] = dot4_pair(hi[r][g], whi[0], xhi[r][0], whi[1], xhi[r][1]);
        }
      }
    }
  } else {
    for (int c = 0; c < 4; ++c) {
      VI xlo[R], xhi[R];
      for (int r = 0; r < R; ++r) {
        xlo[r] = bcast4(xb[r] + 4 * c);
        xhi[r] = bcast4(xb[r] + 16 + 4 * c);
      }
      for (int g = 0; g < G; ++g) {
        VI wlo, whi;
        weights(g, c, wlo, whi);
        for (int r = 0; r < R; ++r) {
          if constexpr (SCALED) lo[r][g] = dot4_pair_scaled(lo[r][g], wlo, xlo[r], whi, xhi[r], scales[g]);
          else lo[r][g] = dot4_pair(lo[r][g], wlo, xlo[r], whi, xhi[r]);
        }
      }
    }
  }
}

template <Quant F>
constexpr bool has_min = F == Quant::Q4_1 || F == Quant::Q5_1 || F == Quant::Q4_K || F == Quant::Q5_K;

// Step 3 for one block ``b`` of superblock ``sb`` and row ``row``: ``acc`` plus the block's exact integer dot ``sum``
// scaled (the weights' scales ``dw``, minimums or dmins ``mw``), whichever kernel computed the dot.
template <Quant F>
__attribute__((always_inline)) inline VF block_sum(VF acc, VI sum, VF dw, VF mw, const uint8_t* sb,
                                                   const QuantRows& xq, int64_t row, int64_t b,
                                                   const VI* min_pairs = nullptr) {
  const int64_t i = row * xq.blocks + b;
  if constexpr (F == Quant::Q4_0) sum = minus(sum, 8 * xq.s[i]);  // quants minus 8
  if constexpr (F == Quant::Q5_0) sum = minus(sum, 16 * xq.s[i]);  // quants minus 16
  acc = fma_int(scaled(dw, xq.d[i]), sum, acc);
  if constexpr (F == Quant::Q4_1 || F == Quant::Q5_1) acc = fma_scalar(mw, xq.ds[i], acc);
  if constexpr (F == Quant::Q4_K || F == Quant::Q5_K) {  // minus dmin * d_x * sum_j min_j * (the rows' sum j)
    const int32_t* s = xq.s.data() + row * xq.sums + b * 16;
    VI mins = izero();
    if (min_pairs) {  // (`min_pairs`) each two sub-blocks' mins times the row's two sums in one widening
      for (int k = 0; k < 4; ++k) {
        const int32_t s0 = s[4 * k] + s[4 * k + 1], s1 = s[4 * k + 2] + s[4 * k + 3];  // |s| <= 32 * 127
        mins = add(mins, madd16(min_pairs[k], bcast32(static_cast<int32_t>((static_cast<uint32_t>(s1) << 16) |
                                                                            (static_cast<uint32_t>(s0) & 0xFFFF)))));
      }
    } else {
      for (int j = 0; j < 8; ++j) mins = add(mins, mul(widen_u8(sb + 192 + 16 * j), s[2 * j] + s[2 * j + 1]));
    }
    acc = fnma_int(scaled(mw, xq.d[i]), mins, acc);
  }
  return acc;
}

// The first ``rows`` rows' sums ``acc`` [rows][G] into ``out`` [rows][stride] from column ``col``, plus the bias.
template <int G>
inline void store_rows(const VF (*acc)[G], int rows, const float* bias, float* out, int64_t stride, int64_t col) {
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) {
      float* o = out + r * stride + col + g * 16;
      store(o, acc[r][g]);
      if (bias)
        for (int j = 0; j < 16; ++j) o[j] += bias[col + g * 16 + j];
    }
}

// Fetches the G superblocks ``AHEAD`` on from block ``b`` of ``nb`` (``block`` bytes between G's, ``bytes`` per
// superblock); past this pass's last, the next pass's first (a thread's next pass): its weights then arrive during
// this pass's products instead of stalling the next pass's first loads. (An address, not a pointer: past the weights'
// last group it points nowhere, and a prefetch never faults.)
template <int G>
inline void prefetch_ahead(const uint8_t* w, int64_t b, int64_t nb, int64_t block, int64_t bytes) {
  for (int g = 0; g < G; ++g) {
    const int64_t off = b + AHEAD < nb ? g * block + (b + AHEAD) * bytes : (G + g) * block + (b + AHEAD - nb) * bytes;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(w) + off;
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
  }
}

// A Q4_K/Q5_K superblock's 8 sub-blocks' mins (6 bits, at ``sb + 192``) as 4 vectors of two int16 per lane
// (sub-blocks 2k and 2k + 1): what `block_sum` multiplies with a row's sums, two sub-blocks in one widening.
inline void min_pairs_of(const uint8_t* sb, VI* pairs) {
  for (int k = 0; k < 4; ++k) {
    const VI low = widen_u8(sb + 192 + 32 * k), high = widen_u8(sb + 192 + 32 * k + 16);
    pairs[k] = add(low, mul(high, 65536));
  }
}

// The weights of G blocks (``block`` bytes apart) of format F, not Q8_0, one byte each, as `nibble_dots` reads them
// with SPREAD: ``out`` [superblocks][inputs / 32][G][512]. A pass over many rows unpacks its nibbles (and the bits
// above them) once here instead of once per ROWS rows.
template <Quant F, int G>
void spread_group(const uint8_t* w, int64_t block, int64_t nb, uint8_t* out) {
  constexpr int64_t head = Format<F>::HEAD, bytes = Format<F>::BYTES, subs = Format<F>::INPUTS / 32;
  constexpr bool fifth = F == Quant::Q5_0 || F == Quant::Q5_1 || F == Quant::Q5_K, q6 = F == Quant::Q6_K;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t j = 0; j < subs; ++j)
      for (int g = 0; g < G; ++g) {
        const uint8_t* sb = w + g * block + b * bytes;
        const uint8_t* quants = sb + head + 256 * j;
        const uint8_t* highs = subs == 1 ? sb + head + 256 : sb + head + 2048 + (q6 ? 128 : 64) * j;
        const VI h0 = fifth || q6 ? load64(highs) : izero(), h1 = q6 ? load64(highs + 64) : izero();
        uint8_t* o = out + ((b * subs + j) * G + g) * 512;
        for (int c = 0; c < 4; ++c) {
          VI lo, hi;
          chunk_weights<fifth, q6>(quants, h0, h1, c, lo, hi);
          store64(o + 64 * c, lo);
          store64(o + 64 * (c + 4), hi);
        }
      }
}

// R rows (from ``r0``) times G blocks of weights (``block`` bytes apart) into ``out`` [R][stride] from column
// ``col``, plus the bias: steps 2 and 3 of the file comment, each output's blocks in input order. With SPREAD the
// quants are read from ``spread`` (`spread_group` of these G blocks), else unpacked here.
template <Quant F, int R, int G, bool SPREAD>
void quant_pass(const QuantRows& xq, int64_t r0, const uint8_t* w, int64_t block, const float* bias, float* out,
                int64_t stride, int64_t col, const uint8_t* spread) {
  constexpr int64_t head = Format<F>::HEAD, bytes = Format<F>::BYTES, inputs = Format<F>::INPUTS;
  constexpr int64_t subs = inputs / 32;
  const int64_t in = xq.in, nb = xq.blocks;
  VF acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sb[G];
    for (int g = 0; g < G; ++g) sb[g] = w + g * block + b * bytes;
    if constexpr (!SPREAD) prefetch_ahead<G>(w, b, nb, block, bytes);
    const int8_t* xb[R];
    for (int r = 0; r < R; ++r) xb[r] = xq.q.data() + (r0 + r) * in + b * inputs;
    VI dot[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) dot[r][g] = izero();
    // sub-block j's quants: spread, or as stored (the bits above the nibbles at ``highs``)
    const uint8_t *quants[G], *highs[G];
    const auto locate = [&](int64_t j) {
      for (int g = 0; g < G; ++g) {
        quants[g] = SPREAD ? spread + ((b * subs + j) * G + g) * 512 : sb[g] + head + 256 * j;
        highs[g] = subs == 1 ? sb[g] + head + 256 : sb[g] + head + 2048 + (F == Quant::Q6_K ? 128 : 64) * j;
      }
    };
    if constexpr (F == Quant::Q8_0) {
      VI sums[G];
      for (int g = 0; g < G; ++g) sums[g] = izero();
      for (int j = 0; j < 8; ++j) {
        VI x4[R];
        for (int r = 0; r < R; ++r) x4[r] = q8_input(bcast4(xb[r] + 4 * j));
        for (int g = 0; g < G; ++g) {
          const Signed wv = signed_weights(load64(sb[g] + head + 64 * j));
          sums[g] = q8_weight_sum(sums[g], wv);
          for (int r = 0; r < R; ++r) dot[r][g] = dot4_signed(dot[r][g], wv, x4[r]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) dot[r][g] = q8_correct(dot[r][g], sums[g]);
    } else if constexpr (!K_QUANT<F>) {  // Q4_0, Q4_1, Q5_0, Q5_1: quants 0..15 (0..31), offsets below
      constexpr bool fifth = F == Quant::Q5_0 || F == Quant::Q5_1;
      locate(0);
      nibble_dots<R, G, fifth && !SPREAD, false, false, SPREAD>(quants, highs, xb, dot, dot);
    } else {  // the K-quants, per 32 inputs j: Q4_K/Q5_K: sumi += scale_j * dot_j, the mins' part below from the
      // rows' sums; Q6_K: per 16 inputs, sumi += scale * (dot - 32 * the rows' sum); all exact
      constexpr bool q6 = F == Quant::Q6_K;
      for (int j = 0; j < 8; ++j) {
        const int8_t* xj[R];
        VI lo[R][G], hi[R][G];
        for (int r = 0; r < R; ++r) {
          xj[r] = xb[r] + 32 * j;
          for (int g = 0; g < G; ++g) lo[r][g] = hi[r][g] = izero();
        }
        locate(j);
        if constexpr (SCALE_IN_DOTS && !q6) {  // Q4_K, Q5_K: each dot times its sub-block's scale in the widening
          VI scales[G];
          for (int g = 0; g < G; ++g) scales[g] = scale_pairs(widen_u8(sb[g] + 64 + 16 * j));
          nibble_dots<R, G, F == Quant::Q5_K && !SPREAD, false, false, SPREAD, true>(quants, highs, xj, dot, hi,
                                                                                     scales);
          continue;
        }
        nibble_dots<R, G, F == Quant::Q5_K && !SPREAD, q6 && !SPREAD, q6, SPREAD>(quants, highs, xj, lo, hi);
        for (int g = 0; g < G; ++g) {
          if constexpr (q6) {
            const VI scale_lo = widen_i8(sb[g] + 32 + 32 * j), scale_hi = widen_i8(sb[g] + 32 + 32 * j + 16);
            for (int r = 0; r < R; ++r) {
              const int32_t* s = xq.s.data() + (r0 + r) * xq.sums + b * 16 + 2 * j;
              const VI part = add(mul(scale_lo, minus(lo[r][g], 32 * s[0])), mul(scale_hi, minus(hi[r][g], 32 * s[1])));
              dot[r][g] = add(dot[r][g], part);
            }
          } else {
            const VI scale = widen_u8(sb[g] + 64 + 16 * j);
            for (int r = 0; r < R; ++r) dot[r][g] = add(dot[r][g], mul(scale, lo[r][g]));
          }
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const VF dw = half16(sb[g]), mw = has_min<F> ? half16(sb[g] + 32) : dw;
      if constexpr (SCALE_IN_DOTS && (F == Quant::Q4_K || F == Quant::Q5_K)) {
        VI pairs[4];
        min_pairs_of(sb[g], pairs);
        for (int r = 0; r < R; ++r)
          acc[r][g] = block_sum<F>(acc[r][g], dot[r][g], dw, mw, sb[g], xq, r0 + r, b, pairs);
      } else {
        for (int r = 0; r < R; ++r) acc[r][g] = block_sum<F>(acc[r][g], dot[r][g], dw, mw, sb[g], xq, r0 + r, b);
      }
    }
  }
  store_rows<G>(acc, R, bias, out, stride, col);
}

template <Quant F, int R, int G, bool SPREAD>
void quant_tail(const QuantRows& xq, int64_t r0, int64_t rows, const uint8_t* w, int64_t block, const float* bias,
                float* out, int64_t stride, int64_t col, const uint8_t* spread) {
  if constexpr (R > 0) {
    if (rows == R) return quant_pass<F, R, G, SPREAD>(xq, r0, w, block, bias, out, stride, col, spread);
    quant_tail<F, R - 1, G, SPREAD>(xq, r0, rows, w, block, bias, out, stride, col, spread);
  }
}

// All ``n`` rows times G blocks from block ``b``, ROWS (Q6_K: ROWS_Q6) rows a pass; with SPREAD reading the quants
// from ``spread`` (`spread_group`).
template <Quant F, int G, bool SPREAD>
void quant_group(const QuantRows& xq, int64_t n, const uint8_t* w, int64_t block, const float* bias, float* out,
                 int64_t stride, int64_t col, const uint8_t* spread) {
  constexpr int rows = F == Quant::Q6_K ? ROWS_Q6 : ROWS;
  int64_t r = 0;
  for (; r + rows <= n; r += rows)
    quant_pass<F, rows, G, SPREAD>(xq, r, w, block, bias, out + r * stride, stride, col, spread);
  if (r < n) quant_tail<F, rows - 1, G, SPREAD>(xq, r, n - r, w, block, bias, out + r * stride, stride, col, spread);
}

// From this many rows a pass spreads its quants to bytes once (`spread_group`) rather than unpacking them per ROWS
// rows: above a verification's widths, so decode steps and verification run as before.
constexpr int64_t SPREAD_ROWS = 17;

// ``n`` rows times G blocks of weights from ``w``: spread first where that pays (``buffer`` its room).
template <Quant F, int G>
void quant_blocks(const QuantRows& xq, int64_t n, const uint8_t* w, int64_t block, const float* bias, float* out,
                  int64_t stride, int64_t col, std::vector<uint8_t>& buffer) {
  if constexpr (F != Quant::Q8_0) {  // Q8_0's quants are bytes as stored
    if (n >= SPREAD_ROWS) {
      buffer.resize(xq.blocks * (Format<F>::INPUTS / 32) * G * 512);
      spread_group<F, G>(w, block, xq.blocks, buffer.data());
      return quant_group<F, G, true>(xq, n, w, block, bias, out, stride, col, buffer.data());
    }
  }
  quant_group<F, G, false>(xq, n, w, block, bias, out, stride, col, nullptr);
}

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define LATTICE_QUANT_TILES 1
// --- AMX tiles ------------------------------------------------------------------------------------------------------
// From `tile_rows` rows (5 or 32), the 32-input formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) take step 2's dots from AMX:
// one tile product gives up to 16 rows x 16 outputs' exact dots over a block of 32 inputs (the rows' signed bytes times the
// weights' bytes into int32: `tdpbssd` for Q8_0's signed quants, `tdpbsud` for the others' unsigned ones), where the
// vector kernel spends 8 dot products per row. A Q8_0 superblock's 512 bytes of quants are the tile's B layout as
// they are (8 rows of 4 inputs x 16 outputs); the others' nibbles (and fifth bits) are spread to bytes in that layout
// first, once for all the rows. Step 3 is `block_sum`, the vector kernel's operations in the same order, so every sum
// is the same bits at any width and on either path. A pass's weights (4 blocks of 16 outputs) stay in the cache
// while every 16 rows of a long input pass over them.

// Fewest rows whose products run on tiles: a tile product, and the store of its sums that every block of 32 inputs
// needs (each block has its own scales), cost about the same at any number of rows, so below some rows the vector dots
// cost less. Q8_0's quants need no spreading: tiles from 5 rows. The nibble formats' are spread once per pass, which
// pays from two chunks of rows on, and their vector dots are cheap: tiles from 32 rows (`bench/bench_quant_tiles.py`,
// bench/RESULTS.md 2026-12-07).
template <Quant F>
constexpr int64_t tile_rows = F == Quant::Q8_0 ? 5 : 32;
template <Quant F>
constexpr bool TILED = !K_QUANT<F>;
constexpr int TILE_GROUP = 4;  // blocks of 16 outputs per pass, one int32 tile each (tiles 0-3)

struct QuantTileConfig {  // palette 1: tiles 0-3 the dots (m rows x 16 int32), 4 the rows' 32 inputs, 5-6 weights
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {64, 64, 64, 64, 32, 64, 64};
  uint8_t rows[16] = {0, 0, 0, 0, 0, 8, 8};
  explicit QuantTileConfig(int m) {
    for (int t = 0; t < 5; ++t) rows[t] = static_cast<uint8_t>(m);
  }
};

// One superblock's quants in the tiles' B layout: Q8_0's as stored, the others' spread into ``buffer`` (512 bytes).
template <Quant F>
inline const uint8_t* b_layout(const uint8_t* sb, uint8_t* buffer) {
  constexpr int64_t head = Format<F>::HEAD;
  if constexpr (F == Quant::Q8_0) {
    return sb + head;
  } else {
    constexpr bool fifth = F == Quant::Q5_0 || F == Quant::Q5_1;
    const VI h = fifth ? load64(sb + head + 256) : izero();  // the fifth bits, once for the 4 chunks
    for (int c = 0; c < 4; ++c) {
      VI lo, hi;
      nibbles(sb + head + 64 * c, lo, hi);
      if constexpr (fifth) {
        lo = high_bits(lo, h, c, 1);
        hi = high_bits(hi, h, c + 4, 1);
      }
      _mm512_store_si512(buffer + 64 * c, lo.v);
      _mm512_store_si512(buffer + 64 * (c + 4), hi.v);
    }
    return buffer;
  }
}

// Tile C = the rows (tile 4) times 32 inputs' weights ``quants`` (B layout) of format F, loaded into tile B. A macro:
// the compiler's tile intrinsics take the tiles' numbers as literal text.
#define LATTICE_TILE_DOT(F, C, B, quants)                   \
  do {                                                      \
    _tile_zero(C);                                          \
    _tile_loadd(B, quants, 64);                             \
    if constexpr (F == Quant::Q8_0) _tile_dpbssd(C, 4, B);  \
    else _tile_dpbsud(C, 4, B);                             \
  } while (0)

// Rows [r0, r0 + m) (m <= 16, the tile configuration for m rows loaded) times G blocks of weights (``block`` bytes
// apart) into ``out`` [m][stride] from column ``col``, plus the bias. ``spread``: the G blocks' quants already in the
// B layout ([blocks][G][512], `spread_pass`), else null (spread here). With ``prefetch`` the weights are fetched
// ahead as `quant_pass` fetches them (a later 16 rows finds them in the cache).
template <Quant F, int G>
void tile_pass(const QuantRows& xq, int64_t r0, int m, const uint8_t* w, int64_t block, const float* bias,
               float* out, int64_t stride, int64_t col, const uint8_t* spread, bool prefetch) {
  constexpr int64_t bytes = Format<F>::BYTES;
  const int64_t in = xq.in, nb = xq.blocks;
  alignas(64) int32_t dots[G][16][16];
  alignas(64) uint8_t here[G][512];
  VF acc[16][G];
  for (int r = 0; r < m; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = fzero();
  const int8_t* x = xq.q.data() + r0 * in;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sb[G];
    for (int g = 0; g < G; ++g) sb[g] = w + g * block + b * bytes;
    if (prefetch) prefetch_ahead<G>(w, b, nb, block, bytes);
    const uint8_t* quants[G];
    for (int g = 0; g < G; ++g) quants[g] = spread ? spread + (b * G + g) * 512 : b_layout<F>(sb[g], here[g]);
    _tile_loadd(4, x + b * 32, in);
    LATTICE_TILE_DOT(F, 0, 5, quants[0]);
    if constexpr (G > 1) LATTICE_TILE_DOT(F, 1, 6, quants[1]);
    if constexpr (G > 2) LATTICE_TILE_DOT(F, 2, 5, quants[2]);
    if constexpr (G > 3) LATTICE_TILE_DOT(F, 3, 6, quants[3]);
    _tile_stored(0, dots[0], 64);
    if constexpr (G > 1) _tile_stored(1, dots[1], 64);
    if constexpr (G > 2) _tile_stored(2, dots[2], 64);
    if constexpr (G > 3) _tile_stored(3, dots[3], 64);
    for (int g = 0; g < G; ++g) {
      const VF dw = half16(sb[g]), mw = has_min<F> ? half16(sb[g] + 32) : dw;
      for (int r = 0; r < m; ++r)
        acc[r][g] = block_sum<F>(acc[r][g], load64(reinterpret_cast<const uint8_t*>(dots[g][r])), dw, mw, sb[g], xq,
                                 r0 + r, b);
    }
  }
  store_rows<G>(acc, m, bias, out, stride, col);
}

// A pass's G blocks' quants of format F (not Q8_0, whose are the B layout already) in the B layout, once for all
// its 16-row chunks: ``out`` [blocks][G][512].
template <Quant F>
void spread_pass(const uint8_t* w, int64_t block, int64_t nb, int64_t width, uint8_t* out) {
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t g = 0; g < width; ++g)
      b_layout<F>(w + g * block + b * Format<F>::BYTES, out + (b * width + g) * 512);
}

// ``n`` rows times every block of 16 outputs, on tiles: per pass of G blocks, every 16 rows.
template <Quant F>
void tile_all(const QuantRows& xq, int64_t n, const uint8_t* wp, int64_t blocks, const float* bias, float* out,
              int64_t stride, int64_t col) {
  const int64_t block = xq.blocks * Format<F>::BYTES;
  constexpr bool spreads = F != Quant::Q8_0;
  at::parallel_for(0, blocks, TILE_GROUP, [&](int64_t b0, int64_t b1) {
    int loaded = 0;  // the rows the loaded configuration is for
    // with more than one chunk of rows, the nibbles are spread once per pass, not once per chunk
    std::vector<uint8_t> bytes(spreads && n > 16 ? xq.blocks * TILE_GROUP * 512 + 64 : 0);
    uint8_t* spread = bytes.empty() ? nullptr : bytes.data() + (-reinterpret_cast<uintptr_t>(bytes.data()) & 63);
    for (int64_t b = b0; b < b1; b += TILE_GROUP) {
      const int64_t width = std::min<int64_t>(TILE_GROUP, b1 - b);
      const uint8_t* w = wp + b * block;
      if (spread) spread_pass<F>(w, block, xq.blocks, width, spread);
      for (int64_t r = 0; r < n; r += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, n - r));
        if (m != loaded) {
          const QuantTileConfig config(m);
          _tile_loadconfig(&config);
          loaded = m;
        }
        float* o = out + r * stride;
        const int64_t c = col + b * 16;
        if (width == 4) tile_pass<F, 4>(xq, r, m, w, block, bias, o, stride, c, spread, r == 0);
        else if (width == 3) tile_pass<F, 3>(xq, r, m, w, block, bias, o, stride, c, spread, r == 0);
        else if (width == 2) tile_pass<F, 2>(xq, r, m, w, block, bias, o, stride, c, spread, r == 0);
        else tile_pass<F, 1>(xq, r, m, w, block, bias, o, stride, c, spread, r == 0);
      }
    }
    if (loaded) _tile_release();
  });
}

#endif  // AMX

// ``n`` rows times every block of 16 outputs into ``out`` [n][stride] from column ``col``.
template <Quant F>
void quant_all(const QuantRows& xq, int64_t n, const uint8_t* wp, int64_t blocks, const float* bias, float* out,
               int64_t stride, int64_t col) {
#ifdef LATTICE_QUANT_TILES
  if constexpr (TILED<F>)
    if (n >= tile_rows<F> && amx_on()) return tile_all<F>(xq, n, wp, blocks, bias, out, stride, col);
#endif
  const int64_t block = xq.blocks * Format<F>::BYTES;
  at::parallel_for(0, blocks, GROUP, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> buffer;
    for (int64_t b = b0; b < b1; b += GROUP) {
      if (b + GROUP <= b1) quant_blocks<F, GROUP>(xq, n, wp + b * block, block, bias, out, stride, col + b * 16, buffer);
      else quant_blocks<F, 1>(xq, n, wp + b * block, block, bias, out, stride, col + b * 16, buffer);
    }
  });
}

}  // namespace
#endif  // LATTICE_QUANT

std::string quant_linear_kernel() { return KERNEL; }

std::string quant_linear_tiles() {
#ifdef LATTICE_QUANT_TILES
  if (amx_on()) return "amx_int8";
#endif
  return "";
}

namespace {

// The shape checks of one part: its outputs and inputs.
std::pair<int64_t, int64_t> checked_part(const torch::Tensor& packed) {
  check_cpu(packed, "quant_linear", "packed");
  TORCH_CHECK(quant_packed(packed),
              "quant_linear: the weight must be quant_pack's layout (uint8 [out/16, in/32 or in/256, superblock bytes "
              "of Q8_0 544, Q4_0 288, Q4_1 320, Q5_0 352, Q5_1 384, Q4_K 2368, Q5_K 2880, Q6_K 3360])");
  return {packed.size(0) * 16, packed.size(1) * quant_inputs(packed.size(2))};
}

#ifdef LATTICE_QUANT
void quant_part(const QuantRows& xq, int64_t n, const torch::Tensor& packed, const float* bias, float* out,
                int64_t stride, int64_t col) {
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t blocks = packed.size(0);
  switch (packed.size(2)) {
    case Format<Quant::Q8_0>::BYTES: return quant_all<Quant::Q8_0>(xq, n, wp, blocks, bias, out, stride, col);
    case Format<Quant::Q4_0>::BYTES: return quant_all<Quant::Q4_0>(xq, n, wp, blocks, bias, out, stride, col);
    case Format<Quant::Q4_1>::BYTES: return quant_all<Quant::Q4_1>(xq, n, wp, blocks, bias, out, stride, col);
    case Format<Quant::Q5_0>::BYTES: return quant_all<Quant::Q5_0>(xq, n, wp, blocks, bias, out, stride, col);
    case Format<Quant::Q5_1>::BYTES: return quant_all<Quant::Q5_1>(xq, n, wp, blocks, bias, out, stride, col);
    case Format<Quant::Q4_K>::BYTES: return quant_all<Quant::Q4_K>(xq, n, wp, blocks, bias, out, stride, col);
    case Format<Quant::Q5_K>::BYTES: return quant_all<Quant::Q5_K>(xq, n, wp, blocks, bias, out, stride, col);
    default: return quant_all<Quant::Q6_K>(xq, n, wp, blocks, bias, out, stride, col);
  }
}
#endif

}  // namespace

torch::Tensor quant_linear_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(!quant_linear_kernel().empty(), "quant_linear: this build has neither AVX512BW nor AVX2 with FMA");
  TORCH_CHECK(!parts.empty(), "quant_linear: no weight given");
  int64_t in = -1, out = 0;
  for (const torch::Tensor& part : parts) {
    const auto [rows, inputs] = checked_part(part);
    TORCH_CHECK(in < 0 || inputs == in, "quant_linear: fused weights take ", in, " and ", inputs, " inputs");
    in = inputs;
    out += rows;
  }
  TORCH_CHECK(x.defined() && x.device().is_cpu(), "quant_linear: x must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "quant_linear: float32 input expected, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "quant_linear: input of ", x.size(-1), " features, the weight takes ",
              in);
  TORCH_CHECK(!bias.has_value() ||
                  (bias->device().is_cpu() && bias->numel() == out && bias->scalar_type() == torch::kFloat32),
              "quant_linear: a float32 CPU bias of ", out, " values expected");
  const torch::Tensor rows_in = x.reshape({-1, in}).contiguous();
  const int64_t n = rows_in.size(0);
  torch::Tensor result = linear_output(x, out);
#ifdef LATTICE_QUANT
  if (n == 0) return result;
  const torch::Tensor bc = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = bias.has_value() ? bc.data_ptr<float>() : nullptr;
  // the rows quantized once per kind of activation the parts take (Q8_0's blocks of 32, Q8_K's of 256)
  c10::optional<QuantRows> rows32, rows256;
  int64_t col = 0;
  for (const torch::Tensor& part : parts) {
    const bool k_quant = quant_inputs(part.size(2)) == 256;
    c10::optional<QuantRows>& rows = k_quant ? rows256 : rows32;
    if (!rows.has_value()) rows = quantize_rows(rows_in.data_ptr<float>(), n, in, k_quant);
    quant_part(*rows, n, part, bp, result.data_ptr<float>(), out, col);
    col += part.size(0) * 16;
  }
#endif
  return result;
}

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  return quant_linear_parts(x, {packed}, bias);
}

// ---------------------------------------------------------------------------------------------- quant_pack, natively
// The same bytes `quant_linear.quant_pack` (Python, the reference) lays out, in one pass: each GGUF block read into its
// integer quants and scales (ggml-common.h's layouts), written where the products read them (the file comment).
namespace {

struct Block {  // one output's block, decoded
  uint8_t q[256];
  uint16_t d = 0, m = 0;  // float16 bits: the scale, the minimum (Q4_1, Q5_1) or dmin (Q4_K, Q5_K)
  uint8_t scales[16] = {}, mins[8] = {};
};

inline uint16_t half_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void k_scales(const uint8_t* s, uint8_t* scales, uint8_t* mins) {  // get_scale_min_k4
  for (int j = 0; j < 4; ++j) {
    scales[j] = s[j] & 63;
    mins[j] = s[j + 4] & 63;
    scales[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    mins[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

void decode(const std::string& kind, const uint8_t* b, Block& out) {
  if (kind == "Q8_0") {
    out.d = half_at(b);
    std::memcpy(out.q, b + 2, 32);
  } else if (kind == "Q4_0" || kind == "Q4_1" || kind == "Q5_0" || kind == "Q5_1") {
    const bool with_min = kind == "Q4_1" || kind == "Q5_1", fifth = kind[1] == '5';
    out.d = half_at(b);
    if (with_min) out.m = half_at(b + 2);
    const uint8_t* p = b + (with_min ? 4 : 2);
    uint32_t high = 0;
    if (fifth) {
      std::memcpy(&high, p, 4);
      p += 4;
    }
    for (int j = 0; j < 16; ++j) {
      out.q[j] = (p[j] & 15) | (fifth ? ((high >> j) & 1) << 4 : 0);
      out.q[j + 16] = (p[j] >> 4) | (fifth ? ((high >> (j + 16)) & 1) << 4 : 0);
    }
  } else if (kind == "Q4_K" || kind == "Q5_K") {
    const bool fifth = kind == "Q5_K";
    out.d = half_at(b);
    out.m = half_at(b + 2);
    k_scales(b + 4, out.scales, out.mins);
    const uint8_t *qh = b + 16, *qs = b + (fifth ? 48 : 16);
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l) {
        out.q[64 * i + l] = (qs[32 * i + l] & 15) | (fifth ? ((qh[l] >> (2 * i)) & 1) << 4 : 0);
        out.q[64 * i + 32 + l] = (qs[32 * i + l] >> 4) | (fifth ? ((qh[l] >> (2 * i + 1)) & 1) << 4 : 0);
      }
  } else {  // Q6_K: ql[128], qh[64], scales[16], d
    const uint8_t *ql = b, *qh = b + 128;
    std::memcpy(out.scales, b + 192, 16);
    out.d = half_at(b + 208);
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t a = ql[64 * h + l], c = ql[64 * h + l + 32], hi = qh[32 * h + l];
        out.q[128 * h + l] = (a & 15) | ((hi & 3) << 4);
        out.q[128 * h + l + 32] = (c & 15) | (((hi >> 2) & 3) << 4);
        out.q[128 * h + l + 64] = (a >> 4) | (((hi >> 4) & 3) << 4);
        out.q[128 * h + l + 96] = (c >> 4) | (((hi >> 6) & 3) << 4);
      }
  }
}

PackedFormat packed_format(const std::string& kind) {
  for (const PackedFormat& f : PACKED_FORMATS)
    if (kind == f.name) return f;
  TORCH_CHECK(false, "quant_pack: unsupported GGUF quantization '", kind, "'");
  __builtin_unreachable();
}

// Output o's decoded block into superblock ``sb`` (see the file comment's layout).
void place(const std::string& kind, const PackedFormat& f, const Block& blk, int o, uint8_t* sb) {
  std::memcpy(sb + 2 * o, &blk.d, 2);
  int64_t head = 32;
  if (kind == "Q4_1" || kind == "Q5_1" || kind == "Q4_K" || kind == "Q5_K") {
    std::memcpy(sb + 32 + 2 * o, &blk.m, 2);
    head = 64;
  }
  if (kind == "Q4_K" || kind == "Q5_K") {
    for (int j = 0; j < 8; ++j) {
      sb[64 + 16 * j + o] = blk.scales[j];
      sb[192 + 16 * j + o] = blk.mins[j];
    }
    head = 320;
  } else if (kind == "Q6_K") {
    for (int j = 0; j < 16; ++j) sb[32 + 16 * j + o] = blk.scales[j];
    head = 288;
  }
  if (kind == "Q8_0") {
    for (int g = 0; g < 8; ++g)
      for (int t = 0; t < 4; ++t) sb[head + 64 * g + 4 * o + t] = blk.q[4 * g + t];
    return;
  }
  const int parts = static_cast<int>(f.inputs / 32);
  const int64_t highs = head + 256 * parts;
  for (int p = 0; p < parts; ++p) {
    const uint8_t* q = blk.q + 32 * p;
    for (int c = 0; c < 4; ++c)
      for (int t = 0; t < 4; ++t)
        sb[head + 256 * p + 64 * c + 4 * o + t] = (q[4 * c + t] & 15) | ((q[16 + 4 * c + t] & 15) << 4);
    for (int t = 0; t < 4; ++t) {
      if (kind == "Q5_0" || kind == "Q5_1" || kind == "Q5_K") {
        uint8_t bits = 0;
        for (int g = 0; g < 8; ++g) bits |= ((q[4 * g + t] >> 4) & 1) << g;
        sb[highs + 64 * p + 4 * o + t] = bits;
      } else if (kind == "Q6_K") {
        uint8_t low = 0, high = 0;
        for (int c = 0; c < 4; ++c) {
          low |= ((q[4 * c + t] >> 4) & 3) << (2 * c);
          high |= ((q[16 + 4 * c + t] >> 4) & 3) << (2 * c);
        }
        sb[highs + 128 * p + 4 * o + t] = low;
        sb[highs + 128 * p + 64 + 4 * o + t] = high;
      }
    }
  }
}

}  // namespace

torch::Tensor quant_pack_native(const torch::Tensor& raw, const std::string& kind) {
  const PackedFormat f = packed_format(kind);
  check_tensor(raw, "quant_pack", "raw", 2, torch::kUInt8);
  TORCH_CHECK(raw.size(1) % f.block_bytes == 0, "a ", kind, " tensor is uint8 [out, blocks * ", f.block_bytes,
              "], got ", raw.sizes());
  TORCH_CHECK(raw.size(0) % 16 == 0, "a quantized weight's outputs must be a multiple of 16, got ", raw.size(0));
  const int64_t groups = raw.size(0) / 16, blocks = raw.size(1) / f.block_bytes, row = raw.size(1);
  torch::Tensor packed = torch::zeros({groups, blocks, f.packed_bytes}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, groups * blocks, 64, [&](int64_t i0, int64_t i1) {
    Block blk;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / blocks, b = i % blocks;
      for (int o = 0; o < 16; ++o) {
        decode(kind, src + (g * 16 + o) * row + b * f.block_bytes, blk);
        place(kind, f, blk, o, dst + i * f.packed_bytes);
      }
    }
  });
  return packed;
}

// ------------------------------------------------------------------------------------- rows read back from the layout
// The float32 rows ``ids`` of a `quant_pack`ed weight, bit for bit what `quant_linear.dequantize` gives for the file's
// blocks (each value's products are exact but Q6_K's one, a single rounding as there): an embedding tied to its output
// layer looks its rows up in the output layer's blocks, one copy of the vocabulary's weights instead of two.
namespace {

inline float half_float(const uint8_t* p) { return static_cast<float>(c10::Half(half_at(p), c10::Half::from_bits())); }

void read_row(const std::string& kind, const PackedFormat& f, const uint8_t* sb, int o, float* y) {
  const float d = half_float(sb + 2 * o);
  if (kind == "Q8_0") {
    for (int g = 0; g < 8; ++g)
      for (int t = 0; t < 4; ++t) y[4 * g + t] = d * static_cast<float>(static_cast<int8_t>(sb[32 + 64 * g + 4 * o + t]));
    return;
  }
  const bool k_quant = f.inputs == 256;
  const int64_t head = kind == "Q4_0" || kind == "Q5_0" ? 32 : kind == "Q4_1" || kind == "Q5_1" ? 64 : kind == "Q6_K" ? 288 : 320;
  const int parts = static_cast<int>(f.inputs / 32);
  const int64_t highs = head + 256 * parts;
  for (int p = 0; p < parts; ++p) {
    uint8_t q[32];
    for (int c = 0; c < 4; ++c)
      for (int t = 0; t < 4; ++t) {
        const uint8_t both = sb[head + 256 * p + 64 * c + 4 * o + t];
        q[4 * c + t] = both & 15;
        q[16 + 4 * c + t] = both >> 4;
      }
    for (int t = 0; t < 4; ++t) {
      if (kind == "Q5_0" || kind == "Q5_1" || kind == "Q5_K") {
        const uint8_t bits = sb[highs + 64 * p + 4 * o + t];
        for (int g = 0; g < 8; ++g) q[4 * g + t] |= ((bits >> g) & 1) << 4;
      } else if (kind == "Q6_K") {
        const uint8_t low = sb[highs + 128 * p + 4 * o + t], high = sb[highs + 128 * p + 64 + 4 * o + t];
        for (int c = 0; c < 4; ++c) {
          q[4 * c + t] |= ((low >> (2 * c)) & 3) << 4;
          q[16 + 4 * c + t] |= ((high >> (2 * c)) & 3) << 4;
        }
      }
    }
    float* out = y + 32 * p;
    if (!k_quant) {
      const float offset = kind == "Q4_0" ? 8.0f : kind == "Q5_0" ? 16.0f : 0.0f;
      const bool with_min = kind == "Q4_1" || kind == "Q5_1";
      const float m = with_min ? half_float(sb + 32 + 2 * o) : 0.0f;
      for (int j = 0; j < 32; ++j) out[j] = with_min ? d * static_cast<float>(q[j]) + m : d * (static_cast<float>(q[j]) - offset);
    } else if (kind == "Q6_K") {
      for (int h = 0; h < 2; ++h) {
        const float scale = d * static_cast<float>(static_cast<int8_t>(sb[32 + 16 * (2 * p + h) + o]));
        for (int j = 0; j < 16; ++j) out[16 * h + j] = scale * (static_cast<float>(q[16 * h + j]) - 32.0f);
      }
    } else {
      const float scale = d * static_cast<float>(sb[64 + 16 * p + o]);
      const float low = half_float(sb + 32 + 2 * o) * static_cast<float>(sb[192 + 16 * p + o]);
      for (int j = 0; j < 32; ++j) out[j] = scale * static_cast<float>(q[j]) - low;
    }
  }
}

}  // namespace

torch::Tensor quant_rows(const torch::Tensor& packed, const torch::Tensor& ids, const std::string& kind) {
  const PackedFormat f = packed_format(kind);
  check_tensor(packed, "quant_rows", "packed", 3, torch::kUInt8);
  TORCH_CHECK(packed.size(2) == f.packed_bytes, "quant_rows: not a packed ", kind, " weight");
  check_tensor(ids, "quant_rows", "ids", 1, torch::kInt64);
  const int64_t outputs = packed.size(0) * 16, blocks = packed.size(1), in = blocks * f.inputs, n = ids.size(0);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < outputs, "quant_rows: row ", idp[i], " of ", outputs);
  torch::Tensor out = torch::empty({n, in}, torch::kFloat32);
  const uint8_t* base = packed.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = idp[i] / 16;
      const int o = static_cast<int>(idp[i] % 16);
      for (int64_t b = 0; b < blocks; ++b)
        read_row(kind, f, base + (g * blocks + b) * f.packed_bytes, o, y + i * in + b * f.inputs);
    }
  });
  return out;
}
