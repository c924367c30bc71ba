// Linear layers over one bfloat16 weight layout, float32 sums, every row computed the same way at any width: on
// Intel AMX tiles where the CPU has them, else with AVX512-BF16 dot products (AMD Zen 4 and later, Intel Cooper
// Lake and later).
//
// Why: a decode step of a small model reads all its weights once per token, so its products are bound by memory
// bandwidth; oneDNN's packed bfloat16 linear reads them at well below what the machine can stream at 1-16 rows
// (and on AVX512-BF16 CPUs without AMX splits its reduction differently from 4 rows up), while one AMX tile
// product (16 rows x 32 inputs x 16 outputs) costs about what its 1 KiB of weights costs to read, and one
// AVX512-BF16 dot product (16 outputs x 2 inputs) about what its 64 bytes cost: products of 1 to 16 rows (a step,
// a verification) cost about one read of the weights.
//
// How: the weight is laid out once as [out/16][in/2][16][2] (`tile_pack`), so that each 16-output block's tiles
// are contiguous 1 KiB pieces and each pair of inputs' 16 outputs one 64-byte vector. A call walks groups of four
// 16-output blocks (in parallel over the threads).
// - AMX: for each group and each 16-row chunk of the input it accumulates the four blocks' sums over the inputs,
//   32 at a time, in float32 tiles. Rows are always computed in a 16-row tile (a shorter chunk is padded with zero
//   rows), so a row's sums follow the same sequence whichever width and position it comes with.
// - AVX512-BF16: each output of each row has one float32 accumulator that takes the input pairs in order, one
//   `vdpbf16ps` each, up to four rows sharing each loaded weight vector; the inputs are walked in slices that
//   stay in the L1 cache while every row chunk passes over them (the sums wait in memory between slices, exactly);
//   from five rows on, the passes over one slice fetch the next into L2. A row's sums are the same sequence of
//   operations at any width.
// Either way the bias is added last and the sum rounded to bfloat16 (round to nearest even): a k-row product
// equals k 1-row products bit for bit. The two kernels round differently from each other; one process uses one.
#include "amx.h"
#include "tensor_checks.h"
#include "tile_linear.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define LATTICE_DOTS 1
#include <immintrin.h>
#endif
#if defined(LATTICE_DOTS) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define LATTICE_TILES 1
#endif

torch::Tensor tile_pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.defined() && weight.device().is_cpu(), "tile_pack: the weight must be a CPU tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "tile_pack: a 2-d bfloat16 weight");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(out % 16 == 0 && in % 32 == 0, "tile_pack: [out, in] = [", out, ", ", in,
              "], out must be a multiple of 16 and in of 32");
  return weight.contiguous().view({out / 16, 16, in / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

namespace {

#ifdef LATTICE_DOTS
// Rows [r][G * 16] of float32 sums, plus the bias, rounded to bfloat16 into the output's columns from ``col``.
inline void finish(const float* sums, int64_t rows, int64_t cols, const float* bias, uint16_t* out, int64_t stride,
                   int64_t col) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; j += 16) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + r * cols + j), _mm512_loadu_ps(bias + col + j));
      const __m256bh h = _mm512_cvtneps_pbh(v);
      std::memcpy(out + r * stride + col + j, &h, 32);
    }
  }
}

// --- AVX512-BF16 -------------------------------------------------------------------------------------------------

constexpr int64_t SLICE = 64;  // input pairs per pass: four blocks' 64 pairs are 16 KiB of weights, in L1

constexpr int64_t PREFETCH_ROWS = 5;  // from this many rows the weights' next slice is fetched while this one runs

// Adds input pairs [p0, p1) of R rows ``x`` (pairs per row ``pairs``) times G blocks of weights to ``sums``
// [R][G * 16], one `vdpbf16ps` per pair, row and block, each output's pairs in order. With each of its first
// ``lines`` pairs it asks for one cache line more of each of the ``ahead`` weight streams ``next`` (into L2):
// prefetches change no sum.
template <int R, int G>
inline void dot_chunk(const uint32_t* x, int64_t pairs, const uint16_t* w, int64_t block, int64_t p0, int64_t p1,
                      float* sums, const char* const* next = nullptr, int ahead = 0, int64_t lines = 0) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_loadu_ps(sums + (r * G + g) * 16);
  for (int64_t p = p0; p < p1; ++p) {
    if (p - p0 < lines)
      for (int i = 0; i < ahead; ++i) _mm_prefetch(next[i] + (p - p0) * 64, _MM_HINT_T1);
    __m512bh wv[G];
    for (int g = 0; g < G; ++g) wv[g] = (__m512bh)_mm512_loadu_si512(w + g * block + p * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * pairs + p]));
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wv[g], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(sums + (r * G + g) * 16, acc[r][g]);
}

// All ``n`` rows times one group of G blocks: ``sums`` [n][G * 16] (zeroed here). From `PREFETCH_ROWS` rows the
// passes over a slice are bound by the dot products, not by memory, so the first passes of four rows also fetch
// the next slice of the G blocks (spread over them, one line per pair and block): its weights then stream in
// while the products run instead of stalling the next slice's first pass (16 rows of SmolLM2's products: about
// 15 % less time on a Zen 4, bench/RESULTS.md).
template <int G>
void dot_group(const uint32_t* x, int64_t n, int64_t pairs, const uint16_t* w, int64_t block, float* sums) {
  constexpr int64_t cols = G * 16;
  std::fill(sums, sums + n * cols, 0.0f);
  const int64_t passes = n / 4;
  for (int64_t p0 = 0; p0 < pairs; p0 += SLICE) {
    const int64_t p1 = std::min(pairs, p0 + SLICE);
    const int64_t lines = n >= PREFETCH_ROWS ? std::min(pairs, p1 + SLICE) - p1 : 0;  // the next slice's pairs
    int64_t r = 0;
    for (int64_t c = 0; r + 4 <= n; r += 4, ++c) {
      const char* next[G];
      int ahead = 0;
      if (lines > 0)
        for (int64_t g = c; g < G; g += passes) next[ahead++] = reinterpret_cast<const char*>(w + g * block + p1 * 32);
      dot_chunk<4, G>(x + r * pairs, pairs, w, block, p0, p1, sums + r * cols, next, ahead, lines);
    }
    const uint32_t* xr = x + r * pairs;
    float* sr = sums + r * cols;
    if (n - r == 3) dot_chunk<3, G>(xr, pairs, w, block, p0, p1, sr);
    else if (n - r == 2) dot_chunk<2, G>(xr, pairs, w, block, p0, p1, sr);
    else if (n - r == 1) dot_chunk<1, G>(xr, pairs, w, block, p0, p1, sr);
  }
}

void dot_linear(const uint16_t* xp, int64_t n, int64_t in, const uint16_t* wp, int64_t blocks, const float* bias,
                uint16_t* op) {
  const int64_t block = in * 16, pairs = in / 2, out = blocks * 16;
  const auto* x = reinterpret_cast<const uint32_t*>(xp);
  at::parallel_for(0, blocks, 4, [&](int64_t k0, int64_t k1) {
    std::vector<float> sums(n * 64);
    for (int64_t b0 = k0; b0 < k1; b0 += 4) {
      const int64_t width = std::min<int64_t>(4, k1 - b0);
      const uint16_t* wg = wp + b0 * block;
      if (width == 4) dot_group<4>(x, n, pairs, wg, block, sums.data());
      else if (width == 3) dot_group<3>(x, n, pairs, wg, block, sums.data());
      else if (width == 2) dot_group<2>(x, n, pairs, wg, block, sums.data());
      else dot_group<1>(x, n, pairs, wg, block, sums.data());
      finish(sums.data(), n, width * 16, bias, op, out, b0 * 16);
    }
  });
}
#endif  // LATTICE_DOTS

#ifdef LATTICE_TILES
// --- AMX ---------------------------------------------------------------------------------------------------------

struct TileConfig {  // the AMX tile configuration (palette 1): 8 tiles of 16 rows x 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Tiles 0..G-1 accumulate G blocks of 16 outputs for 16 rows ``a`` (row stride ``stride`` bytes); tile 4 holds the
// rows' 32 inputs, tiles 5 and 6 take turns holding a block's weights for them. Writes the sums to ``sums``
// [16][G * 16].
template <int G>
inline void tile_group(const uint16_t* a, int64_t stride, const uint16_t* w, int64_t block, int64_t chunks,
                       float* sums) {
  _tile_zero(0);
  if (G > 1) _tile_zero(1);
  if (G > 2) _tile_zero(2);
  if (G > 3) _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* wc = w + c * 512;  // 16 input pairs x 16 outputs x 2
    _tile_loadd(4, a + c * 32, stride);
    _tile_loadd(5, wc, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (G > 1) { _tile_loadd(6, wc + block, 64); _tile_dpbf16ps(1, 4, 6); }
    if (G > 2) { _tile_loadd(5, wc + 2 * block, 64); _tile_dpbf16ps(2, 4, 5); }
    if (G > 3) { _tile_loadd(6, wc + 3 * block, 64); _tile_dpbf16ps(3, 4, 6); }
  }
  _tile_stored(0, sums, G * 64);
  if (G > 1) _tile_stored(1, sums + 16, G * 64);
  if (G > 2) _tile_stored(2, sums + 32, G * 64);
  if (G > 3) _tile_stored(3, sums + 48, G * 64);
}

void amx_linear(const uint16_t* xp, int64_t n, int64_t in, const uint16_t* wp, int64_t blocks, const float* bias,
                uint16_t* op) {
  const int64_t full = n / 16, tail = n % 16, chunks = in / 32, out = blocks * 16;
  const int64_t block = in * 16, groups = (blocks + 3) / 4;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    const TileConfig config;
    _tile_loadconfig(&config);
    std::vector<uint16_t> padded(tail ? 16 * in : 0, 0);  // the last rows, padded to a full tile with zeros
    if (tail) std::memcpy(padded.data(), xp + full * 16 * in, tail * in * sizeof(uint16_t));
    alignas(64) float sums[16 * 64];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * 4, width = std::min<int64_t>(4, blocks - b0);
      const uint16_t* wg = wp + b0 * block;
      for (int64_t c = 0; c < full + (tail ? 1 : 0); ++c) {
        const uint16_t* a = c < full ? xp + c * 16 * in : padded.data();
        if (width == 4) tile_group<4>(a, in * 2, wg, block, chunks, sums);
        else if (width == 3) tile_group<3>(a, in * 2, wg, block, chunks, sums);
        else if (width == 2) tile_group<2>(a, in * 2, wg, block, chunks, sums);
        else tile_group<1>(a, in * 2, wg, block, chunks, sums);
        finish(sums, c < full ? 16 : tail, width * 16, bias, op + c * 16 * out, out, b0 * 16);
      }
    }
    _tile_release();
  });
}
#endif  // LATTICE_TILES

}  // namespace

std::string tile_linear_kernel() {
#ifdef LATTICE_TILES
  if (amx_on()) return "amx";
#endif
#ifdef LATTICE_DOTS
  return "avx512_bf16";
#else
  return "";
#endif
}

void prefer_amx(bool prefer) { amx_preferred() = prefer; }

bool tile_linear_available() { return !tile_linear_kernel().empty(); }

torch::Tensor tile_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  const std::string kernel = tile_linear_kernel();
  TORCH_CHECK(!kernel.empty(), "tile_linear: this build has neither AVX512-BF16 nor AMX support");
  check_cpu(packed, "tile_linear", "packed");
  TORCH_CHECK(tile_packed(packed) && packed.scalar_type() == torch::kBFloat16,
              "tile_linear: the weight must come from tile_pack");
  TORCH_CHECK(x.defined() && x.device().is_cpu(), "tile_linear: x must be a CPU tensor");
  TORCH_CHECK(!bias.has_value() || bias->device().is_cpu(), "tile_linear: bias must be a CPU tensor");
  const int64_t blocks = packed.size(0), in = packed.size(1) * 2, out = blocks * 16;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "tile_linear: bfloat16 input expected, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "tile_linear: input of ", x.size(-1), " features, the weight takes ", in);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out && bias->scalar_type() == torch::kBFloat16),
              "tile_linear: a bfloat16 bias of ", out, " values expected");
  const torch::Tensor rows_in = x.reshape({-1, in}).contiguous();
  const int64_t n = rows_in.size(0);
  torch::Tensor result = linear_output(x, out);
  if (n == 0) return result;
  std::vector<float> b(out, 0.0f);
  if (bias.has_value()) {
    const torch::Tensor bc = bias->contiguous();
    const c10::BFloat16* bp = bc.data_ptr<c10::BFloat16>();
    for (int64_t j = 0; j < out; ++j) b[j] = static_cast<float>(bp[j]);
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(rows_in.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(result.data_ptr());
#ifdef LATTICE_TILES
  if (kernel == "amx") {
    amx_linear(xp, n, in, wp, blocks, b.data(), op);
    return result;
  }
#endif
#ifdef LATTICE_DOTS
  dot_linear(xp, n, in, wp, blocks, b.data(), op);
#endif
  return result;
}
