// Linear layers on Intel AMX tiles, bfloat16 in, float32 sums, every row computed the same way at any width.
//
// Why: a decode step of a small model reads all its weights once per token, so its products are bound by memory
// bandwidth; oneDNN's packed bfloat16 linear reads them at well below what the machine can stream at 1-16 rows,
// while one AMX tile product (16 rows x 32 inputs x 16 outputs) costs about what its 1 KiB of weights costs to
// read, so products of 1 to 16 rows (a step, a verification) cost about the same.
//
// How: the weight is laid out once as [out/16][in/2][16][2] (`tile_pack`), so that each 16-output block's tiles
// are contiguous 1 KiB pieces. A call walks groups of four 16-output blocks (in parallel over the threads);
// for each group and each 16-row chunk of the input it accumulates the four blocks' sums over the inputs, 32 at a
// time, in float32 tiles, then adds the bias and rounds to bfloat16 (round to nearest even). Rows are always
// computed in a 16-row tile (a shorter chunk is padded with zero rows), so a row's sums follow the same sequence
// whichever width and position it comes with: a k-row product equals k 1-row products bit for bit.
#include "tile_linear.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define LATTICE_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

torch::Tensor tile_pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "tile_pack: a 2-d bfloat16 weight");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(out % 16 == 0 && in % 32 == 0, "tile_pack: [out, in] = [", out, ", ", in,
              "], out must be a multiple of 16 and in of 32");
  return weight.contiguous().view({out / 16, 16, in / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#ifdef LATTICE_TILES
namespace {

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

}  // namespace

bool tile_linear_available() {
  // Linux hands out the tiles' register state only on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

torch::Tensor tile_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(tile_linear_available(), "tile_linear: this process cannot use AMX tiles");
  TORCH_CHECK(tile_packed(packed) && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous(),
              "tile_linear: the weight must come from tile_pack");
  const int64_t blocks = packed.size(0), in = packed.size(1) * 2, out = blocks * 16;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "tile_linear: bfloat16 input expected, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "tile_linear: input of ", x.size(-1), " features, the weight takes ", in);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out && bias->scalar_type() == torch::kBFloat16),
              "tile_linear: a bfloat16 bias of ", out, " values expected");
  const torch::Tensor rows_in = x.reshape({-1, in}).contiguous();
  const int64_t n = rows_in.size(0), full = n / 16, tail = n % 16, chunks = in / 32;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  torch::Tensor result = torch::empty(shape, x.options());
  std::vector<float> b(out, 0.0f);
  if (bias.has_value()) {
    const torch::Tensor bc = bias->contiguous();
    const c10::BFloat16* bp = bc.data_ptr<c10::BFloat16>();
    for (int64_t j = 0; j < out; ++j) b[j] = static_cast<float>(bp[j]);
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(rows_in.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(result.data_ptr());
  const int64_t block = in * 16, groups = (blocks + 3) / 4;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    const TileConfig config;
    _tile_loadconfig(&config);
    std::vector<uint16_t> padded(tail ? 16 * in : 0, 0);  // the last rows, padded to a full tile with zeros
    if (tail) std::memcpy(padded.data(), xp + full * 16 * in, tail * in * sizeof(uint16_t));
    alignas(64) float sums[16 * 64];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * 4, width = std::min<int64_t>(4, blocks - b0), cols = width * 16;
      const uint16_t* wg = wp + b0 * block;
      for (int64_t c = 0; c < full + (tail ? 1 : 0); ++c) {
        const uint16_t* a = c < full ? xp + c * 16 * in : padded.data();
        if (width == 4) tile_group<4>(a, in * 2, wg, block, chunks, sums);
        else if (width == 3) tile_group<3>(a, in * 2, wg, block, chunks, sums);
        else if (width == 2) tile_group<2>(a, in * 2, wg, block, chunks, sums);
        else tile_group<1>(a, in * 2, wg, block, chunks, sums);
        const int64_t rows = c < full ? 16 : tail;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < cols; j += 16) {
            const __m512 v = _mm512_add_ps(_mm512_load_ps(sums + r * cols + j), _mm512_loadu_ps(b.data() + b0 * 16 + j));
            const __m256bh h = _mm512_cvtneps_pbh(v);
            std::memcpy(op + (c * 16 + r) * out + b0 * 16 + j, &h, 32);
          }
        }
      }
    }
    _tile_release();
  });
  return result;
}

#else  // no AMX in this build: `tile_linear_available` says so and the callers use oneDNN

bool tile_linear_available() { return false; }

torch::Tensor tile_linear(const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "tile_linear: this build has no AMX support");
}

#endif
