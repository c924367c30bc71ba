// The row-wise parts of a Llama/Qwen decoder layer as single calls, for the lean forward's decode-matched steps.
//
// Each op computes every row (and every head of a row) with one fixed sequence of float operations that depends
// only on that row's data and the keys it may see, never on how many rows came with it: a k-row call equals k
// 1-row calls bit for bit. Roundings follow transformers' modules (Llama/Qwen RMSNorm, rotary embedding, SiLU
// MLP in the model dtype; attention in float32 as the block attention computes it), so the logits stay within
// float rounding of the model's own forward. Reductions use 8 float lanes (GCC vector extensions: the same
// order on every x86 CPU and compiler target), combined pairwise in a fixed order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <map>
#include <vector>

#include "quant_linear.h"
#include "rows_linear.h"
#include "tensor_checks.h"
#include "tile_linear.h"

namespace {

typedef float f8 __attribute__((vector_size(32)));
constexpr int L = 8;

inline f8 load8(const float* p) { f8 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof v); }
inline float sum8(f8 v) {
  float s[L]; std::memcpy(s, &v, sizeof s);
  float a = (s[0] + s[4]) + (s[2] + s[6]);
  float b = (s[1] + s[5]) + (s[3] + s[7]);
  return a + b;
}

typedef int32_t i8v __attribute__((vector_size(32)));
typedef uint32_t u8v __attribute__((vector_size(32)));
typedef uint16_t h8v __attribute__((vector_size(16)));

inline f8 splat(float v) { return f8{v, v, v, v, v, v, v, v}; }
inline f8 vmin(f8 a, f8 b) { return a < b ? a : b; }
inline f8 vmax(f8 a, f8 b) { return a > b ? a : b; }

// 8 numbers of type T (float, bfloat16, or float16: a KV cache's storage) as floats, exactly.
inline f8 widen8(const float* p) { return load8(p); }
inline f8 widen8(const c10::Half* p) {
#ifdef __F16C__
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  f8 out; std::memcpy(&out, &v, sizeof out); return out;
#else
  float lanes[L];
  for (int i = 0; i < L; ++i) lanes[i] = static_cast<float>(p[i]);
  return load8(lanes);
#endif
}
inline f8 widen8(const c10::BFloat16* p) {
  h8v h; std::memcpy(&h, p, sizeof h);
  u8v u = __builtin_convertvector(h, u8v) << 16;
  f8 v; std::memcpy(&v, &u, sizeof v); return v;
}

// 8 floats rounded to T (round to nearest even, as c10::BFloat16 rounds; NaN stays NaN), as floats.
inline f8 round8(f8 v, const float*) { return v; }
inline f8 round8(f8 v, const c10::BFloat16*) {
  u8v b; std::memcpy(&b, &v, sizeof b);
  u8v r = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  r = (v != v) ? u8v{0x7FC00000u, 0x7FC00000u, 0x7FC00000u, 0x7FC00000u, 0x7FC00000u, 0x7FC00000u, 0x7FC00000u,
                     0x7FC00000u} : r;
  f8 out; std::memcpy(&out, &r, sizeof out); return out;
}
// Store 8 floats already rounded to T (`round8`) as T.
inline void store_as(float* p, f8 v) { store8(p, v); }
inline void store_as(c10::BFloat16* p, f8 v) {
  u8v b; std::memcpy(&b, &v, sizeof b);
  h8v h = __builtin_convertvector(b >> 16, h8v);
  std::memcpy(p, &h, sizeof h);
}

// exp of 8 floats (Cephes' expf polynomial, within 2 ulp over the float range; exp(-88.4 or less) underflows
// to ~0): the same value for a number whichever lane it sits in.
inline f8 vexp(f8 x) {
  x = vmax(vmin(x, splat(88.3762626647949f)), splat(-88.3762626647949f));
  f8 fx = x * splat(1.44269504088896341f) + splat(0.5f);
  i8v t = __builtin_convertvector(fx, i8v);
  f8 ft = __builtin_convertvector(t, f8);
  fx = ft > fx ? ft - splat(1.0f) : ft;  // floor
  x = x - fx * splat(0.693359375f);
  x = x - fx * splat(-2.12194440e-4f);
  f8 z = x * x;
  f8 y = splat(1.9875691500E-4f);
  y = y * x + splat(1.3981999507E-3f);
  y = y * x + splat(8.3334519073E-3f);
  y = y * x + splat(4.1665795894E-2f);
  y = y * x + splat(1.6666665459E-1f);
  y = y * x + splat(5.0000001201E-1f);
  y = y * z + x + splat(1.0f);
  i8v e = (__builtin_convertvector(fx, i8v) + 127) << 23;
  f8 scale; std::memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

// x rounded to the storage type T, back as float (identity for float).
template <typename T> inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }
template <typename T> inline float wide(T x) { return static_cast<float>(x); }

// Dot product of n floats (n a multiple of 8 or not): lane-wise, tail in order, fixed combination.
inline float dot(const float* a, const float* b, int64_t n) {
  f8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + L <= n; i += L) acc += load8(a + i) * load8(b + i);
  float s = sum8(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Sum of squares of n floats (the RMSNorm variance numerator).
inline float sumsq(const float* a, int64_t n) { return dot(a, a, n); }

// transformers' RMSNorm of one row of n values (already float): w * to_T(h * rsqrt(mean(h^2) + eps)).
template <typename T>
inline void norm_row(const float* h, const T* w, double eps, int64_t n, T* out) {
  const float var = sumsq(h, n) / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(var + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(wide(w[i]) * rnd<T>(h[i] * r));
}

// RMSNorm of every row of x [rows, n] into out; with y (the same shape), first x += y in place (the residual
// stream, rounded to T as torch rounds it) and the norm of the sum. Rows in parallel from 4 rows up.
template <typename T>
void norm_rows_impl(torch::Tensor& x, const torch::Tensor* y, const torch::Tensor& w, double eps,
                    torch::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* yp = y == nullptr ? nullptr : y->data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, rows >= 4 ? 1 : rows, [&](int64_t begin, int64_t end) {
    std::vector<float> h(n);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        if (yp != nullptr) xp[r * n + i] = static_cast<T>(wide(xp[r * n + i]) + wide(yp[r * n + i]));
        h[i] = wide(xp[r * n + i]);
      }
      norm_row<T>(h.data(), wp, eps, n, op + r * n);
    }
  });
}

// One head's rotary embedding (transformers' apply_rotary_pos_emb with rotate_half), in place on ``v`` (float
// values of type-T numbers): v * cos + rotate_half(v) * sin, each product and the sum rounded to T.
template <typename T>
inline void rotate(float* v, const T* cos, const T* sin, int64_t d) {
  const int64_t half = d / 2;
  float out[512];
  for (int64_t i = 0; i < d; ++i) {
    const float rot = i < half ? -v[i + half] : v[i - half];
    const float a = rnd<T>(v[i] * wide(cos[i]));
    const float b = rnd<T>(rnd<T>(rot) * wide(sin[i]));
    out[i] = rnd<T>(a + b);
  }
  std::memcpy(v, out, d * sizeof(float));
}

// qkv: [n, (H + 2K) * D] (the fused projection's output); norms: per-head q/k RMSNorm weights [D] or undefined;
// cos/sin: [n, D]; caches: [K, capacity, D] of C (T, or float16 under float32 activations) written at rows
// start..start+n-1, each value rounded to C (to nearest even). Returns q as float [H, n, D].
// Rows in parallel from 4 rows up (each row writes only its own q and cache rows).
template <typename T, typename C>
torch::Tensor rope_impl(const torch::Tensor& qkv, const c10::optional<torch::Tensor>& q_norm,
                        const c10::optional<torch::Tensor>& k_norm, double eps, const torch::Tensor& cos,
                        const torch::Tensor& sin, torch::Tensor& k_cache, torch::Tensor& v_cache, int64_t start,
                        int64_t heads, int64_t kv_heads) {
  const int64_t n = qkv.size(0), d = cos.size(1), width = qkv.size(1);
  const int64_t cap = k_cache.size(1);
  TORCH_CHECK(width == (heads + 2 * kv_heads) * d, "qkv width ", width, " != (heads + 2 kv_heads) * head_dim");
  TORCH_CHECK(d <= 512 && d % 2 == 0, "head_dim must be even and at most 512");
  TORCH_CHECK(start + n <= cap, "the cache holds ", cap, " rows, ", start + n, " needed");
  auto q = torch::empty({heads, n, d}, qkv.options().dtype(torch::kFloat32));
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  float* qp = q.data_ptr<float>();
  const T* qn = q_norm.has_value() ? q_norm->data_ptr<T>() : nullptr;
  const T* kn = k_norm.has_value() ? k_norm->data_ptr<T>() : nullptr;
  at::parallel_for(0, n, n >= 4 ? 1 : n, [&](int64_t begin, int64_t end) {
    float h[512];
    T normed[512];
    for (int64_t r = begin; r < end; ++r) {
      const T* row = src + r * width;
      for (int64_t head = 0; head < heads + kv_heads; ++head) {
        const bool is_q = head < heads;
        const T* in = row + head * d;
        const T* nw = is_q ? qn : kn;
        if (nw != nullptr) {
          for (int64_t i = 0; i < d; ++i) h[i] = wide(in[i]);
          norm_row<T>(h, nw, eps, d, normed);
          for (int64_t i = 0; i < d; ++i) h[i] = wide(normed[i]);
        } else {
          for (int64_t i = 0; i < d; ++i) h[i] = wide(in[i]);
        }
        rotate<T>(h, cp + r * d, sp + r * d, d);
        if (is_q) {
          std::memcpy(qp + (head * n + r) * d, h, d * sizeof(float));
        } else {
          C* dst = kc + ((head - heads) * cap + start + r) * d;
          for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<C>(h[i]);
        }
      }
      for (int64_t kv = 0; kv < kv_heads; ++kv) {
        const T* value = row + (heads + kv_heads + kv) * d;
        C* dst = vc + (kv * cap + start + r) * d;
        if constexpr (std::is_same_v<T, C>)
          std::memcpy(dst, value, d * sizeof(T));
        else
          for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<C>(wide(value[i]));
      }
    }
  });
  return q;
}

// A row's softmax numerators in place: exp(score - the largest of its ``count`` scores), lanes from ``count`` up to
// ``padded`` (a multiple of 8) set to zero; returns their sum (8 lanes, then `sum8`) in every lane.
inline f8 exp_scores(float* sc, int64_t count, int64_t padded) {
  f8 top = splat(-INFINITY);  // the largest score: the same whichever order the comparisons take
  int64_t j = 0;
  for (; j + L <= count; j += L) top = vmax(top, load8(sc + j));
  float m = -INFINITY, lanes[L];
  std::memcpy(lanes, &top, sizeof lanes);
  for (int t = 0; t < L; ++t) m = lanes[t] > m ? lanes[t] : m;
  for (; j < count; ++j) m = sc[j] > m ? sc[j] : m;
  f8 total = splat(0.f);
  for (j = 0; j < padded; j += L) {
    f8 e = vexp(load8(sc + j) - splat(m));
    if (j + L > count) {  // the last chunk: lanes past the row's keys count zero
      std::memcpy(lanes, &e, sizeof lanes);
      for (int64_t t = count - j; t < L; ++t) lanes[t] = 0.f;
      std::memcpy(&e, lanes, sizeof e);
    }
    store8(sc + j, e);
    total += e;
  }
  return splat(sum8(total));
}

// The fused multiply-add of 8 lanes, explicitly (one rounding where the CPU has FMA): the same operation in every
// tile shape below, so that a query's sums do not depend on which kernel variant computed them.
inline f8 fmadd(f8 a, f8 b, f8 c) {
#ifdef __FMA__
  return (f8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// Keys per step of `attend`'s online softmax. A row's key list is cut into blocks at the same places (0, 64,
// 128, ... of its list) whichever rows share its run, so its sequence of operations is its own.
constexpr int64_t KEY_BLOCK = 64;

// `attend`'s working memory, one per thread, 8 queries to a vector: the scaled queries and value sums ([vector][dim]
// [8]), a block's keys and values widened (caches other than float32), each lane's running maximum and sum.
struct AttendBuffers {
  std::vector<float> qt, acc, keys, values;
  std::vector<float> top, total;
  std::vector<int32_t> count;   // keys of each query's row
  std::vector<int64_t> fewest;  // per vector, the fewest keys a lane sees (0 where lanes are unused)
  std::vector<int64_t> most;    // per vector, the most keys a lane sees
};

// Scores of NV vectors of 8 queries (``qt``: [vector][dim][8], scaled) against NJ keys (``k[j]``: d floats each):
// s[v][j] = sum over dims c in order of qt[v][c] * k[j][c], one fused multiply-add per dim, whatever NV and NJ.
template <int NV, int NJ>
inline void score_tile(const float* qt, int64_t d, const float* const* k, f8* s, int64_t s_stride) {
  f8 acc[NV][NJ];
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NJ; ++j) acc[v][j] = splat(0.f);
  for (int64_t c = 0; c < d; ++c) {
    f8 q[NV];
    for (int v = 0; v < NV; ++v) q[v] = load8(qt + (v * d + c) * L);
    for (int j = 0; j < NJ; ++j) {
      const f8 kj = splat(k[j][c]);
      for (int v = 0; v < NV; ++v) acc[v][j] = fmadd(q[v], kj, acc[v][j]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NJ; ++j) s[v * s_stride + j] = acc[v][j];
}

// Value sums of NV vectors of 8 queries over dims [c0, c0 + NC): acc[v][c] = acc[v][c] * alpha[v] + sum over the
// block's keys j in order of p[v][j] * value[j][c], one fused multiply-add per key, whatever NV and NC.
template <int NV, int NC>
inline void value_tile(float* acc, int64_t d, int64_t c0, const f8* alpha, const f8* p, int64_t p_stride,
                       const float* const* vr, int64_t nb) {
  f8 a[NV][NC];
  for (int v = 0; v < NV; ++v)
    for (int c = 0; c < NC; ++c) a[v][c] = load8(acc + (v * d + c0 + c) * L) * alpha[v];
  for (int64_t j = 0; j < nb; ++j) {
    f8 pj[NV];
    for (int v = 0; v < NV; ++v) pj[v] = p[v * p_stride + j];
    for (int c = 0; c < NC; ++c) {
      const f8 vc = splat(vr[j][c0 + c]);
      for (int v = 0; v < NV; ++v) a[v][c] = fmadd(pj[v], vc, a[v][c]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int c = 0; c < NC; ++c) store8(acc + (v * d + c0 + c) * L, a[v][c]);
}

// The online softmax's step for one vector of 8 queries over a block's ``nb`` scores ``s`` (keys j0 ..): the
// running maximum ``top`` and sum ``total`` (8 lanes each, updated in place) take the block in; the scores become
// their probabilities exp(s - top); returns the factor that rescales the earlier value sums. Masked (a lane's keys
// end inside the block): keys past a lane's count score -inf and weigh 0. Lanewise throughout, and a lane with no
// key in the block keeps its maximum and sum (factor 1).
template <bool Masked>
inline f8 softmax_step(f8* s, int64_t nb, int64_t j0, const int32_t* count, float* top, float* total) {
  const f8 minus_inf = splat(-INFINITY);
  i8v counts;
  std::memcpy(&counts, count, sizeof counts);
  f8 block_top = minus_inf;
  for (int64_t i = 0; i < nb; ++i) {
    if constexpr (Masked) {
      const i8v key = i8v{0, 0, 0, 0, 0, 0, 0, 0} + static_cast<int32_t>(j0 + i);
      s[i] = key < counts ? s[i] : minus_inf;
    }
    block_top = vmax(block_top, s[i]);
  }
  const f8 old_top = load8(top), new_top = vmax(old_top, block_top);
  const f8 alpha = new_top > old_top ? vexp(old_top - new_top) : splat(1.f);
  f8 sum = load8(total) * alpha;
  for (int64_t i = 0; i < nb; ++i) {
    if constexpr (Masked) s[i] = s[i] > minus_inf ? vexp(s[i] - new_top) : splat(0.f);
    else s[i] = vexp(s[i] - new_top);
    sum += s[i];
  }
  store8(top, new_top);
  store8(total, sum);
  return alpha;
}

// One key block (``nb`` keys from j0, rows ``kr``/``vr`` of d floats) for NV query vectors from vector ``v0``:
// scores in tiles of keys, the softmax step, value sums in tiles of dimensions (tile shapes change no sum).
template <int NV>
void attend_block(AttendBuffers& b, int64_t v0, int64_t d, int64_t j0, int64_t nb, const float* const* kr,
                  const float* const* vr) {
  f8 s[NV][KEY_BLOCK];
  const float* qt = b.qt.data() + v0 * d * L;
  int64_t j = 0;
  if constexpr (NV == 1)  // one vector: 12 keys to a tile (12 sums in flight, as two vectors' 2 x 6)
    for (; j + 12 <= nb; j += 12) score_tile<1, 12>(qt, d, kr + j, &s[0][j], KEY_BLOCK);
  for (; j + 6 <= nb; j += 6) score_tile<NV, 6>(qt, d, kr + j, &s[0][j], KEY_BLOCK);
  switch (nb - j) {
    case 1: score_tile<NV, 1>(qt, d, kr + j, &s[0][j], KEY_BLOCK); break;
    case 2: score_tile<NV, 2>(qt, d, kr + j, &s[0][j], KEY_BLOCK); break;
    case 3: score_tile<NV, 3>(qt, d, kr + j, &s[0][j], KEY_BLOCK); break;
    case 4: score_tile<NV, 4>(qt, d, kr + j, &s[0][j], KEY_BLOCK); break;
    case 5: score_tile<NV, 5>(qt, d, kr + j, &s[0][j], KEY_BLOCK); break;
    default: break;
  }
  f8 alpha[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t at = (v0 + v) * L;
    int32_t* count = b.count.data() + at;
    alpha[v] = b.fewest[v0 + v] >= j0 + nb
                   ? softmax_step<false>(s[v], nb, j0, count, b.top.data() + at, b.total.data() + at)
                   : softmax_step<true>(s[v], nb, j0, count, b.top.data() + at, b.total.data() + at);
  }
  float* acc = b.acc.data() + v0 * d * L;
  // d is a multiple of 8: tiles of 6 dimensions (12 for one vector), then one or two of 4
  constexpr int64_t wide = NV == 1 ? 12 : 6;
  int64_t fours = 0;
  while ((d - 4 * fours) % wide != 0) ++fours;
  int64_t c = 0;
  for (; c < d - 4 * fours; c += wide) value_tile<NV, wide>(acc, d, c, alpha, &s[0][0], KEY_BLOCK, vr, nb);
  for (; c < d; c += 4) value_tile<NV, 4>(acc, d, c, alpha, &s[0][0], KEY_BLOCK, vr, nb);
}

// One key-value head's attention for a run of ``rows`` rows whose keys are prefixes of one list (``counts[r]`` keys
// each; a tree's rows come one at a time), flash-style: the rows' ``groups`` query heads 8 to a vector (query
// r * groups + g in lane order), the keys in blocks of `KEY_BLOCK`, each block's scores, running maximum and sum
// (online softmax) and value sums kept per query lane, the output each lane's sums over its sum. Every lane's
// operations are elementwise: a query computes the same sequence in any lane, beside any other queries; a block
// holding none of a row's keys leaves that row's lanes as they were (its scale is 1, its probabilities 0), so a
// row computes what it computes alone, bit for bit (zeros' signs included: the output adds +0). Keys and values
// are stored as C (the cache's type, widened exactly), the output written as O (the activations' type).
template <typename C, typename O>
void attend(const float* qs, int64_t q_stride, int64_t groups, const C* kc, const C* vc, int64_t d,
            const int64_t* keys, const int64_t* counts, int64_t rows, float scale, AttendBuffers& b, O* dst,
            int64_t dst_row_stride, int64_t dst_stride) {
  const int64_t queries = rows * groups, vectors = (queries + L - 1) / L;
  int64_t widest = 0;
  for (int64_t r = 0; r < rows; ++r) widest = std::max(widest, counts[r]);
  b.qt.assign(vectors * d * L, 0.f);
  b.acc.assign(vectors * d * L, 0.f);
  b.top.assign(vectors * L, -INFINITY);
  b.total.assign(vectors * L, 0.f);
  b.count.assign(vectors * L, 0);
  std::vector<int64_t>& last = b.most;
  last.assign(vectors, 0);
  b.fewest.assign(vectors, INT64_MAX);
  if (queries % L != 0) b.fewest[vectors - 1] = 0;  // its unused lanes see no keys
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t r = i / groups, g = i % groups, v = i / L, lane = i % L;
    const float* q = qs + r * d + g * q_stride;
    for (int64_t c = 0; c < d; ++c) b.qt[(v * d + c) * L + lane] = q[c] * scale;
    b.count[i] = static_cast<int32_t>(counts[r]);
    last[v] = std::max(last[v], counts[r]);
    b.fewest[v] = std::min(b.fewest[v], counts[r]);
  }
  const float* kr[KEY_BLOCK];
  const float* vr[KEY_BLOCK];
  if constexpr (!std::is_same_v<C, float>) {
    b.keys.resize(KEY_BLOCK * d);
    b.values.resize(KEY_BLOCK * d);
  }
  for (int64_t j0 = 0; j0 < widest; j0 += KEY_BLOCK) {
    const int64_t nb = std::min(KEY_BLOCK, widest - j0);
    for (int64_t j = 0; j < nb; ++j) {
      const C* k = kc + keys[j0 + j] * d;
      const C* v = vc + keys[j0 + j] * d;
      if constexpr (std::is_same_v<C, float>) {
        kr[j] = k;
        vr[j] = v;
      } else {
        float* kw = b.keys.data() + j * d;
        float* vw = b.values.data() + j * d;
        for (int64_t c = 0; c < d; c += L) {
          store8(kw + c, widen8(k + c));
          store8(vw + c, widen8(v + c));
        }
        kr[j] = kw;
        vr[j] = vw;
      }
    }
    for (int64_t v = 0; v < vectors;) {
      if (last[v] <= j0) { ++v; continue; }  // none of its rows' keys are in this block
      if (v + 1 < vectors && last[v + 1] > j0) {
        attend_block<2>(b, v, d, j0, nb, kr, vr);
        v += 2;
      } else {
        attend_block<1>(b, v, d, j0, nb, kr, vr);
        v += 1;
      }
    }
  }
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t r = i / groups, g = i % groups, v = i / L, lane = i % L;
    O* out = dst + r * dst_row_stride + g * dst_stride;
    const float total = b.total[v * L + lane];
    for (int64_t c = 0; c < d; ++c) out[c] = static_cast<O>(b.acc[(v * d + c) * L + lane] / total + 0.0f);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LATTICE_BF16_ATTENTION 1
// Lane j of the result: the sum of a[j]'s 16 lanes, by one fixed tree (pairs of lanes, then of 128-bit quarters).
inline __m512 sum16x16(const __m512* a) {
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
}

// Two bfloat16 rows of 16 values each as one vector of their pairs: (a[i], b[i]) side by side.
inline __m512i interleave16(const uint16_t* a, const uint16_t* b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                                          _mm256_loadu_si256((const __m256i*)b), 1);
  return _mm512_permutexvar_epi16(idx, both);
}

// Adds one row's value products for NG query heads of one key-value head: ``sums`` [NG][D * 32] floats (head h's
// at ``sums + h * D * 32``), ``probs`` the heads' probabilities as pairs of keys (head h's from ``probs + h *
// stride``), ``v`` ``pairs`` pairs of keys' values (2 * D vectors each). Each head's sums take the pairs in order,
// one `vdpbf16ps` per pair and 16 dimensions, as one head alone would; the heads share each loaded value vector.
template <int D, int NG>
inline void value_sums(float* sums, const uint32_t* probs, int64_t stride, const __m512i (*v)[2 * D],
                       const __m512i* last, int64_t pairs) {
  constexpr int64_t d = D * 32;
  __m512 acc[NG][2 * D];
  for (int h = 0; h < NG; ++h)
    for (int c = 0; c < 2 * D; ++c) acc[h][c] = _mm512_loadu_ps(sums + h * d + c * 16);
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh p[NG];
    for (int h = 0; h < NG; ++h) p[h] = (__m512bh)_mm512_set1_epi32(static_cast<int>(probs[h * stride + i]));
    const __m512i* vi = last != nullptr && i + 1 == pairs ? last : v[i];
    for (int c = 0; c < 2 * D; ++c) {
      const __m512bh vc = (__m512bh)vi[c];
      for (int h = 0; h < NG; ++h) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], vc, p[h]);
    }
  }
  for (int h = 0; h < NG; ++h)
    for (int c = 0; c < 2 * D; ++c) _mm512_storeu_ps(sums + h * d + c * 16, acc[h][c]);
}

// `attend` for bfloat16 caches with AVX512-BF16 dot products, as transformers' bfloat16 attention rounds: the
// query rounded to bfloat16, each score one float32 sum of `vdpbf16ps` products over the head's dimensions (16
// lanes, reduced by `sum16x16`), the softmax in float32, the probabilities rounded to bfloat16, each output lane
// summing its keys' products a pair of keys at a time, in key order. D = head_dim / 32 (dimension pairs come 16
// to a vector). The same sequence for a row at any width, whichever rows come with it.
template <int D>
void attend_bf16(const float* qs, int64_t q_stride, int64_t groups, const c10::BFloat16* kc,
                 const c10::BFloat16* vc, const int64_t* keys, const int64_t* counts, int64_t rows, float scale,
                 std::vector<float>& scores, std::vector<float>& accs, c10::BFloat16* dst, int64_t dst_row_stride,
                 int64_t dst_stride) {
  constexpr int64_t d = D * 32;
  const auto* kh = reinterpret_cast<const uint16_t*>(kc);
  const auto* vh = reinterpret_cast<const uint16_t*>(vc);
  int64_t widest = 0;
  for (int64_t r = 0; r < rows; ++r) widest = std::max(widest, counts[r]);
  const int64_t span = (widest + 15) / 16 * 16;
  scores.resize(rows * groups * span);
  // the queries in bfloat16 (round to nearest even), D vectors of 16 dimension pairs per (row, head)
  std::vector<__m512i> qb(rows * groups * D);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      for (int c = 0; c < D; ++c) {
        const float* qv = qs + r * d + g * q_stride + c * 32;
        qb[(r * groups + g) * D + c] =
            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qv + 16), _mm512_loadu_ps(qv));
      }
  for (int64_t j0 = 0; j0 < span; j0 += 16) {
    const uint16_t* kr[16];
    for (int j = 0; j < 16; ++j) kr[j] = kh + (j0 + j < widest ? keys[j0 + j] : keys[0]) * d;
    for (int64_t r = 0; r < rows; ++r) {
      if (j0 >= counts[r]) continue;
      for (int64_t g = 0; g < groups; ++g) {
        const __m512i* q = qb.data() + (r * groups + g) * D;
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) {
          acc[j] = _mm512_setzero_ps();
          for (int c = 0; c < D; ++c)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(kr[j] + c * 32), (__m512bh)q[c]);
        }
        _mm512_storeu_ps(scores.data() + (r * groups + g) * span + j0,
                         _mm512_mul_ps(sum16x16(acc), _mm512_set1_ps(scale)));
      }
    }
  }
  // softmax per (row, head) over its own keys, in float32; probabilities past a row's keys are zero
  std::vector<uint16_t> probs(rows * groups * span);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t count = counts[r], padded = (count + L - 1) / L * L;
    for (int64_t g = 0; g < groups; ++g) {
      float* sc = scores.data() + (r * groups + g) * span;
      const f8 sum = exp_scores(sc, count, padded);
      uint16_t* pr = probs.data() + (r * groups + g) * span;
      auto* pb = reinterpret_cast<c10::BFloat16*>(pr);
      for (int64_t j = 0; j < padded; j += L) store_as(pb + j, round8(load8(sc + j) / sum, pb));
      for (int64_t j = padded; j < span; ++j) pr[j] = 0;
    }
  }
  // value sums: lanes are dimensions; one `vdpbf16ps` per pair of keys (j, j + 1) and 16 dimensions, in key order
  accs.assign(rows * groups * d, 0.f);
  alignas(64) uint16_t zero[d] = {0};
  __m512i vp[8][2 * D];  // a block of 16 keys as 8 pairs, 2 * D vectors of 16 dimensions each
  for (int64_t j0 = 0; j0 < widest; j0 += 16) {
    for (int i = 0; i < 8; ++i) {
      const int64_t a = j0 + 2 * i, b = a + 1;
      const uint16_t* va = a < widest ? vh + keys[a] * d : zero;
      const uint16_t* vb = b < widest ? vh + keys[b] * d : zero;
      for (int c = 0; c < 2 * D; ++c) vp[i][c] = interleave16(va + c * 16, vb + c * 16);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t count = counts[r];
      if (j0 >= count) continue;
      const int64_t pairs = std::min<int64_t>(8, (count - j0 + 1) / 2);
      const bool odd = count - j0 < 16 && (count - j0) % 2 == 1;  // the row's last pair holds one of its keys
      __m512i last[2 * D];
      if (odd) {
        const int64_t a = count - 1;
        for (int c = 0; c < 2 * D; ++c) last[c] = interleave16(vh + keys[a] * d + c * 16, zero + c * 16);
      }
      // the query heads three at a time (registers: 3 x 2D sums and 2D values), sharing each value vector
      for (int64_t g = 0; g < groups;) {
        const uint32_t* pw = reinterpret_cast<const uint32_t*>(probs.data() + (r * groups + g) * span + j0);
        float* sums = accs.data() + (r * groups + g) * d;
        const int64_t take = std::min<int64_t>(3, groups - g);
        const __m512i* tail = odd ? last : nullptr;
        if (take == 3) value_sums<D, 3>(sums, pw, span / 2, vp, tail, pairs);
        else if (take == 2) value_sums<D, 2>(sums, pw, span / 2, vp, tail, pairs);
        else value_sums<D, 1>(sums, pw, span / 2, vp, tail, pairs);
        g += take;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* sums = accs.data() + (r * groups + g) * d;
      c10::BFloat16* out = dst + r * dst_row_stride + g * dst_stride;
      for (int64_t i = 0; i < d; ++i) out[i] = static_cast<c10::BFloat16>(sums[i]);
    }
}
#endif

bool bf16_attention_dots = true;  // `attention_bf16_dots`

// Most rows of one run of `attention_impl`: they share each key block `attend` widens (and, in `attend_bf16`, a
// run's scores, [rows, groups, keys] floats, stay in the L2 cache: 32 rows x 3 heads x 4096 keys, 1.5 MiB).
constexpr int64_t RUN_ROWS = 32;
// ... and in `attend_bf16`, which keeps a run's scores whole, fewer where the keys are many: a run's scores at most
// this many bytes (past 4096 keys 32 rows' scores left the L2 cache). Which rows share a run changes no row.
constexpr int64_t RUN_SCORE_BYTES = int64_t(1) << 20;

// Whether a call of caches C and output O with head size ``d`` runs on `attend_bf16` (AVX512-BF16 dots).
template <typename C, typename O>
bool bf16_dots(int64_t d) {
#ifdef LATTICE_BF16_ATTENTION
  return std::is_same_v<C, c10::BFloat16> && std::is_same_v<O, c10::BFloat16> && bf16_attention_dots &&
         (d == 64 || d == 128);
#else
  (void)d;
  return false;
#endif
}

// One attention call's inputs (`attention_impl` takes several: the sequences of a batched step): q [H, n, D] float,
// caches [K, capacity, D] of C; row r sees the cache rows keys[spans[r][0] .. spans[r][1]) in that order.
struct AttentionCall {
  torch::Tensor q, k_cache, v_cache, keys, spans, out;
  std::vector<int64_t> counts;  // keys per row
  int64_t run = 1, runs = 1;    // rows per run, runs per head
};

// Attention of each row and key-value head (its ``groups`` query heads together), for every call in ``calls``:
// scores, softmax and the value sum in float32, each (row, head) by the same sequence at any width; output
// [n, H * D] in T per call. Where every row's keys start at the same place (a chain: each row sees a prefix of one
// list), runs of rows share each head's widened keys and values (`attend`); a tree's rows run one by one. The
// units (call, run of rows, key-value head) of all calls share one parallel loop, so a batched step of many
// one-row sequences keeps every thread busy; which rows share a run, and which thread runs it, changes no row.
// C: the caches' type; O: the output's, the activations' (see `attention_calls`).
template <typename C, typename O>
std::vector<torch::Tensor> attention_impl(std::vector<AttentionCall>& calls, double scaling) {
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> first_unit(calls.size() + 1, 0);
  for (size_t c = 0; c < calls.size(); ++c) {
    AttentionCall& call = calls[c];
    const torch::Tensor& q = call.q;
    const int64_t heads = q.size(0), n = q.size(1), d = q.size(2), kv_heads = call.k_cache.size(0);
    const int64_t cap = call.k_cache.size(1), groups = heads / kv_heads;
    TORCH_CHECK(call.spans.dim() == 2 && call.spans.size(0) == n && call.spans.size(1) == 2 &&
                    call.spans.is_contiguous(),
                "spans must be [rows, 2] (begin, end)");
    TORCH_CHECK(d % L == 0 && d <= 256, "head_dim must be a multiple of 8, at most 256");
    TORCH_CHECK(heads % kv_heads == 0, "query heads ", heads, " not a multiple of key-value heads ", kv_heads);
    TORCH_CHECK(groups <= 16, "at most 16 query heads per key-value head");
    const int64_t* kp = call.keys.data_ptr<int64_t>();
    const int64_t* op = call.spans.data_ptr<int64_t>();
    bool shared = true;
    call.counts.resize(n);
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(0 <= op[2 * r] && op[2 * r] < op[2 * r + 1] && op[2 * r + 1] <= call.keys.numel(), "row ", r,
                  " sees keys ", op[2 * r], "..", op[2 * r + 1], " of ", call.keys.numel());
      for (int64_t i = op[2 * r]; i < op[2 * r + 1]; ++i)
        TORCH_CHECK(kp[i] >= 0 && kp[i] < cap, "key row ", kp[i], " outside ", cap);
      call.counts[r] = op[2 * r + 1] - op[2 * r];
      shared = shared && op[2 * r] == op[0];
    }
    call.out = torch::empty({n, heads * d}, q.options().dtype(c10::CppTypeToScalarType<O>::value));
    // Units of (run of rows, key-value head): runs as long as keeps every thread busy, and at most `RUN_ROWS` rows
    // (a long prefill's runs keep their scores in cache).
    int64_t widest = 0;
    for (int64_t r = 0; r < n; ++r) widest = std::max(widest, call.counts[r]);
    const int64_t run_rows =
        bf16_dots<C, O>(d) ? std::clamp<int64_t>(RUN_SCORE_BYTES / (groups * (widest + 15) * 4), 1, RUN_ROWS)
                           : RUN_ROWS;
    const int64_t want = std::max<int64_t>((2 * threads + kv_heads - 1) / kv_heads, (n + run_rows - 1) / run_rows);
    const int64_t per_head = shared ? std::min<int64_t>(n, want) : n;
    call.run = (n + per_head - 1) / per_head;
    call.runs = (n + call.run - 1) / call.run;
    first_unit[c + 1] = first_unit[c] + call.runs * kv_heads;
  }
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, first_unit.back(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, accs;  // `attend_bf16`'s
    AttendBuffers buffers;            // `attend`'s
    size_t c = 0;
    for (int64_t unit = begin; unit < end; ++unit) {
      while (unit >= first_unit[c + 1]) ++c;
      const AttentionCall& call = calls[c];
      const int64_t heads = call.q.size(0), n = call.q.size(1), d = call.q.size(2);
      const int64_t kv_heads = call.k_cache.size(0), cap = call.k_cache.size(1), groups = heads / kv_heads;
      const int64_t runs = call.runs, run = call.run, local = unit - first_unit[c];
      // A causal prefill's later rows see more keys, so the runs are dealt from both ends (first, last, second,
      // second to last, ...): the threads' contiguous shares of units then cost about the same.
      const int64_t slot = local / kv_heads, which = slot % 2 == 0 ? slot / 2 : runs - 1 - slot / 2;
      const int64_t r0 = which * run, rows = std::min(n, r0 + run) - r0, kv = local % kv_heads;
      const float* qs = call.q.data_ptr<float>() + (kv * groups * n + r0) * d;
      const C* kc_h = call.k_cache.data_ptr<C>() + kv * cap * d;
      const C* vc_h = call.v_cache.data_ptr<C>() + kv * cap * d;
      O* dst = call.out.data_ptr<O>() + r0 * heads * d + kv * groups * d;
      const int64_t* ks = call.keys.data_ptr<int64_t>() + call.spans.data_ptr<int64_t>()[2 * r0];
      const int64_t* cs = call.counts.data() + r0;
#ifdef LATTICE_BF16_ATTENTION
      if constexpr (std::is_same_v<C, c10::BFloat16> && std::is_same_v<O, c10::BFloat16>) {
        if (bf16_dots<C, O>(d)) {
          if (d == 64)
            attend_bf16<2>(qs, n * d, groups, kc_h, vc_h, ks, cs, rows, scale, scores, accs, dst, heads * d, d);
          else
            attend_bf16<4>(qs, n * d, groups, kc_h, vc_h, ks, cs, rows, scale, scores, accs, dst, heads * d, d);
          continue;
        }
      }
#endif
      attend<C, O>(qs, n * d, groups, kc_h, vc_h, d, ks, cs, rows, scale, buffers, dst, heads * d, d);
    }
  });
  std::vector<torch::Tensor> outs;
  outs.reserve(calls.size());
  for (const AttentionCall& call : calls) outs.push_back(call.out);
  return outs;
}

// The gated activations, 8 lanes at a time: SiLU x / (1 + e^-x); GELU's tanh form 0.5 x (1 + tanh(u)),
// u = sqrt(2 / pi) (x + 0.044715 x^3), with tanh(u) = 1 - 2 / (e^(2u) + 1) (saturating to +-1 at either end).
struct Silu {
  static f8 apply(f8 x) { return x / (splat(1.0f) + vexp(-x)); }
};
struct GeluTanh {
  static f8 apply(f8 x) {
    const f8 u = splat(0.7978845608028654f) * (x + splat(0.044715f) * x * x * x);
    const f8 t = splat(1.0f) - splat(2.0f) / (vexp(splat(2.0f) * u) + splat(1.0f));
    return splat(0.5f) * x * (splat(1.0f) + t);
  }
};

// gate_up: [n, 2I] (gate then up); returns [n, I] = to_T(act(gate)) * up, rounded to T. Rows in parallel.
template <typename T, typename Act>
torch::Tensor act_mul_impl(const torch::Tensor& gu) {
  const int64_t n = gu.size(0), inter = gu.size(1) / 2;
  auto out = torch::empty({n, inter}, gu.options());
  const T* g = gu.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const T* tag = nullptr;
  at::parallel_for(0, n, n >= 4 ? 1 : n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = g + r * 2 * inter;
      const T* up = gate + inter;
      T* dst = o + r * inter;
      int64_t i = 0;
      for (; i + L <= inter; i += L) {
        const f8 a = round8(Act::apply(widen8(gate + i)), tag);
        store_as(dst + i, round8(a * widen8(up + i), tag));
      }
      if (i < inter) {  // the tail through the same vector code, padded
        float xs[L] = {0}, us[L] = {0}, ys[L];
        for (int64_t t = 0; i + t < inter; ++t) xs[t] = wide(gate[i + t]), us[t] = wide(up[i + t]);
        const f8 a = round8(Act::apply(load8(xs)), tag);
        store8(ys, round8(a * load8(us), tag));
        for (int64_t t = 0; i + t < inter; ++t) dst[i + t] = static_cast<T>(ys[t]);
      }
    }
  });
  return out;
}

void check2d(const torch::Tensor& t, const char* name) {
  check_cpu(t, "lean_ops", name);
  TORCH_CHECK(t.dim() == 2, name, " must be 2-d, got ", t.dim(), "-d");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

#define DISPATCH(dtype, ...)                                     \
  if ((dtype) == torch::kBFloat16) {                             \
    using T = c10::BFloat16;                                     \
    __VA_ARGS__;                                                 \
  } else {                                                       \
    using T = float;                                             \
    __VA_ARGS__;                                                 \
  }

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check2d(x, "x");
  check_vector(w, "rms_norm", "w", x.size(1), x.scalar_type());
  auto out = torch::empty_like(x);
  torch::Tensor input = x;  // read only: no y, so nothing is written to it
  DISPATCH(x.scalar_type(), norm_rows_impl<T>(input, nullptr, w, eps, out));
  return out;
}

torch::Tensor add_rms_norm(torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& w, double eps) {
  check2d(x, "x");
  check2d(y, "y");
  TORCH_CHECK(x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type(), "x and y must match in shape and dtype");
  check_vector(w, "add_rms_norm", "w", x.size(1), x.scalar_type());
  auto out = torch::empty_like(x);
  DISPATCH(x.scalar_type(), norm_rows_impl<T>(x, &y, w, eps, out));
  return out;
}

torch::Tensor rope_qk_cache(const torch::Tensor& qkv, const c10::optional<torch::Tensor>& q_norm,
                            const c10::optional<torch::Tensor>& k_norm, double eps, const torch::Tensor& cos,
                            const torch::Tensor& sin, torch::Tensor& k_cache, torch::Tensor& v_cache, int64_t start,
                            int64_t heads, int64_t kv_heads) {
  check2d(qkv, "qkv");
  const auto dtype = qkv.scalar_type();
  check_tensor(cos, "rope_qk_cache", "cos", 2, dtype);
  check_tensor(sin, "rope_qk_cache", "sin", 2, dtype);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0), "rope_qk_cache: cos and sin must be [",
              qkv.size(0), " rows, head_dim], got ", cos.sizes(), " and ", sin.sizes());
  const auto cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(cache_dtype == dtype || (cache_dtype == torch::kFloat16 && dtype == torch::kFloat32),
              "rope_qk_cache: the caches must be ", dtype, (dtype == torch::kFloat32 ? " or float16" : ""), ", got ",
              cache_dtype);
  check_tensor(k_cache, "rope_qk_cache", "k_cache", 3, cache_dtype);
  check_tensor(v_cache, "rope_qk_cache", "v_cache", 3, cache_dtype);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == kv_heads && k_cache.size(2) == cos.size(1),
              "rope_qk_cache: the caches must be [", kv_heads, " kv heads, capacity, ", cos.size(1),
              "], got ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(start >= 0 && heads > 0 && kv_heads > 0, "rope_qk_cache: start ", start, ", heads ", heads,
              ", kv heads ", kv_heads);
  check_vector(q_norm, "rope_qk_cache", "q_norm", cos.size(1), dtype);
  check_vector(k_norm, "rope_qk_cache", "k_norm", cos.size(1), dtype);
  if (cache_dtype == torch::kFloat16)
    return rope_impl<float, c10::Half>(qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, start, heads, kv_heads);
  DISPATCH(qkv.scalar_type(),
           return rope_impl<T, T>(qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, start, heads, kv_heads));
}

// The checks of one attention call's inputs, and the call (see `attention_impl`).
AttentionCall attention_call(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& keys, const torch::Tensor& spans) {
  check_tensor(q, "attention", "q", 3, torch::kFloat32);
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16 ||
                  k_cache.scalar_type() == torch::kFloat16,
              "attention: k_cache must be float32, bfloat16 or float16, got ", k_cache.scalar_type());
  check_tensor(k_cache, "attention", "k_cache", 3, k_cache.scalar_type());
  check_tensor(v_cache, "attention", "v_cache", 3, k_cache.scalar_type());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == q.size(2) && k_cache.size(0) > 0,
              "attention: q ", q.sizes(), ", k_cache ", k_cache.sizes(), " and v_cache ", v_cache.sizes(),
              " disagree (q [heads, rows, head_dim], caches [kv heads, capacity, head_dim])");
  check_tensor(keys, "attention", "keys", 1, torch::kInt64);
  check_tensor(spans, "attention", "spans", 2, torch::kInt64);
  return AttentionCall{q, k_cache, v_cache, keys, spans, torch::Tensor(), {}};
}

// Attention of every call (their caches of one dtype), each output [n, H * D] in the activations' dtype: the
// caches' own, or float32 for float16 caches (which serve float32 activations only; see `rope_qk_cache`).
std::vector<torch::Tensor> attention_calls(std::vector<AttentionCall>& calls, double scaling) {
  const auto dtype = calls.at(0).k_cache.scalar_type();
  for (const AttentionCall& call : calls)
    TORCH_CHECK(call.k_cache.scalar_type() == dtype, "attention: every call's caches must share one dtype");
  if (dtype == torch::kFloat16) return attention_impl<c10::Half, float>(calls, scaling);  // float32 activations
  DISPATCH(dtype, return attention_impl<T, T>(calls, scaling));
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& keys, const torch::Tensor& spans, double scaling) {
  std::vector<AttentionCall> calls{attention_call(q, k_cache, v_cache, keys, spans)};
  return attention_calls(calls, scaling)[0];
}

torch::Tensor silu_mul(const torch::Tensor& gu) {
  check2d(gu, "gate_up");
  TORCH_CHECK(gu.size(1) % 2 == 0, "silu_mul: gate_up must hold gate then up, an even width; got ", gu.size(1));
  DISPATCH(gu.scalar_type(), return act_mul_impl<T, Silu>(gu));
}

torch::Tensor gelu_tanh_mul(const torch::Tensor& gu) {
  check2d(gu, "gate_up");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gelu_tanh_mul: gate_up must hold gate then up, an even width; got ", gu.size(1));
  DISPATCH(gu.scalar_type(), return act_mul_impl<T, GeluTanh>(gu));
}

namespace {

// The product `packed_linear` computes from Python: over a `tile_pack`ed weight `tile_linear`, over a `rows_pack`ed
// one `rows_linear`, over a `quant_pack`ed one `quant_linear`, else oneDNN's linear over its packed weight, through
// the dispatcher; over several quantized parts (one fused product of mixed formats) `quant_linear_parts`.
torch::Tensor packed_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                            const c10::optional<torch::Tensor>& b) {
  TORCH_CHECK(!parts.empty(), "decode_layers: a product without a weight");
  if (parts.size() > 1) return quant_linear_parts(x, parts, b);  // a fused group of several quantized formats
  const torch::Tensor& w = parts[0];
  if (tile_packed(w)) return tile_linear(x, w, b);
  if (rows_packed(w)) return rows_linear(x, w, b);
  if (quant_packed(w)) return quant_linear(x, w, b);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(b);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<c10::Scalar>>());
  stack.emplace_back(c10::optional<std::string>(std::string("")));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

// Every decoder layer of a matched forward in one call, where each product is one packed matrix whose rows come
// out the same at any width (row plan 1): per layer the fused q/k/v product, `rope_qk_cache`, `attention`, the
// output product, `add_rms_norm`, the fused gate/up product, `silu_mul`, the down product and the next layer's
// `add_rms_norm`: exactly the calls the Python loop makes, without the interpreter between them. ``x`` [n, hidden]
// is updated in place (the residual stream) and returned after the last layer's residual.
//
// The rows may belong to several sequences (a batched step): ``rows[s]`` consecutive rows of sequence ``s``, whose
// keys and values go to its own caches (``k_bufs[l * S + s]`` for layer ``l``) from its own write position
// ``starts[s]``, attending to its own key rows (``keys[s]``, ``spans[s]``). The products and the row-wise ops see
// all rows at once; rotary embedding, the cache write and attention run per sequence, each exactly the call that
// sequence's forward alone makes. So every row is bit for bit what it is alone, whoever shares the forward.
//
// Gemma 3's layers too: ``out_norms`` (two per layer, or none) normalise the attention's and the MLP's outputs before
// their residual adds; ``windows[l]`` (0: none) cuts each row's keys to the last ``windows[l]`` of its span;
// ``rope_of[l]`` picks layer l's rotary tables from ``cos``/``sin``; ``gelu``: GELU (tanh form) gates, else SiLU.
// ``packed_parts``: each product's weight (flat, a list of tensors converts faster than a list of lists), and with
// ``part_counts`` the number of parts of each (a fused group of several quantized formats).
torch::Tensor decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& packed_parts,
                            const std::vector<c10::optional<torch::Tensor>>& biases,
                            const std::vector<torch::Tensor>& norms, double eps,
                            const std::vector<c10::optional<torch::Tensor>>& qk_norms, double qk_eps,
                            const std::vector<torch::Tensor>& k_bufs, const std::vector<torch::Tensor>& v_bufs,
                            const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                            const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& spans,
                            const std::vector<int64_t>& starts, const std::vector<int64_t>& rows, int64_t heads,
                            int64_t kv_heads, double scaling, const std::vector<c10::optional<torch::Tensor>>& out_norms,
                            const std::vector<int64_t>& windows, const std::vector<int64_t>& rope_of, bool gelu,
                            const std::vector<int64_t>& part_counts) {
  const size_t sequences = rows.size();
  TORCH_CHECK(sequences > 0 && keys.size() == sequences && spans.size() == sequences && starts.size() == sequences,
              "decode_layers: per-sequence lists (keys, spans, starts, rows) of mismatched lengths");
  TORCH_CHECK(k_bufs.size() % sequences == 0 && v_bufs.size() == k_bufs.size(),
              "decode_layers: caches must be one per layer and sequence");
  const size_t layers = k_bufs.size() / sequences;
  // the products' weights: one packed matrix each, or (``part_counts``, where given) that many parts side by side
  TORCH_CHECK(part_counts.empty() || part_counts.size() == 4 * layers,
              "decode_layers: part counts must be one per product");
  std::vector<std::vector<torch::Tensor>> packed(4 * layers);
  for (size_t i = 0, next = 0; i < 4 * layers; ++i) {
    const size_t count = part_counts.empty() ? 1 : static_cast<size_t>(part_counts[i]);
    TORCH_CHECK(count > 0 && next + count <= packed_parts.size(), "decode_layers: fewer weights than products");
    packed[i].assign(packed_parts.begin() + next, packed_parts.begin() + next + count);
    next += count;
  }
  TORCH_CHECK(biases.size() == 4 * layers && norms.size() == 2 * layers &&
                  qk_norms.size() == 2 * layers && (out_norms.empty() || out_norms.size() == 2 * layers) &&
                  windows.size() == layers && rope_of.size() == layers,
              "decode_layers: per-layer lists of mismatched lengths");
  TORCH_CHECK(!cos.empty() && cos.size() == sin.size(), "decode_layers: rotary tables (cos, sin) of mismatched counts");
  for (size_t l = 0; l < layers; ++l)
    TORCH_CHECK(rope_of[l] >= 0 && rope_of[l] < static_cast<int64_t>(cos.size()) && windows[l] >= 0,
                "decode_layers: layer ", l, " names rotary table ", rope_of[l], " of ", cos.size(), ", window ",
                windows[l]);
  check2d(x, "x");
  std::vector<int64_t> offsets(sequences + 1, 0);
  for (size_t s = 0; s < sequences; ++s) {
    TORCH_CHECK(rows[s] > 0, "decode_layers: sequence ", s, " has ", rows[s], " rows");
    offsets[s + 1] = offsets[s] + rows[s];
  }
  TORCH_CHECK(offsets[sequences] == x.size(0), "decode_layers: the sequences' rows add up to ", offsets[sequences],
              ", x has ", x.size(0));
  // per window, each sequence's spans cut to the last ``window`` keys of each row (a chain's keys are positions)
  std::map<int64_t, std::vector<torch::Tensor>> windowed;
  for (const int64_t window : windows) {
    if (window == 0 || windowed.count(window)) continue;
    std::vector<torch::Tensor>& cut = windowed[window];
    for (const torch::Tensor& span : spans) {
      torch::Tensor mine = span.clone();
      mine.select(1, 0).copy_(torch::maximum(span.select(1, 0), (span.select(1, 1) - window).clamp_min(0)));
      cut.push_back(mine);
    }
  }
  torch::Tensor h = rms_norm(x, norms[0], eps);
  for (size_t l = 0; l < layers; ++l) {
    const torch::Tensor qkv = packed_linear(h, packed[4 * l], biases[4 * l]);
    const torch::Tensor &c = cos[rope_of[l]], &sn = sin[rope_of[l]];
    const std::vector<torch::Tensor>& seen = windows[l] ? windowed[windows[l]] : spans;
    std::vector<AttentionCall> calls;
    calls.reserve(sequences);
    for (size_t s = 0; s < sequences; ++s) {
      torch::Tensor k_buf = k_bufs[l * sequences + s], v_buf = v_bufs[l * sequences + s];
      const torch::Tensor mine = sequences == 1 ? qkv : qkv.narrow(0, offsets[s], rows[s]);
      const torch::Tensor q = rope_qk_cache(mine, qk_norms[2 * l], qk_norms[2 * l + 1], qk_eps,
                                            sequences == 1 ? c : c.narrow(0, offsets[s], rows[s]),
                                            sequences == 1 ? sn : sn.narrow(0, offsets[s], rows[s]), k_buf, v_buf,
                                            starts[s], heads, kv_heads);
      calls.push_back(attention_call(q, k_buf, v_buf, keys[s], seen[s]));
    }
    const std::vector<torch::Tensor> parts = attention_calls(calls, scaling);
    const torch::Tensor att = sequences == 1 ? parts[0] : torch::cat(parts);
    torch::Tensor out = packed_linear(att, packed[4 * l + 1], biases[4 * l + 1]);
    if (!out_norms.empty() && out_norms[2 * l].has_value()) out = rms_norm(out, *out_norms[2 * l], eps);
    h = add_rms_norm(x, out, norms[2 * l + 1], eps);
    const torch::Tensor gate_up = packed_linear(h, packed[4 * l + 2], biases[4 * l + 2]);
    const torch::Tensor gate = gelu ? gelu_tanh_mul(gate_up) : silu_mul(gate_up);
    torch::Tensor down = packed_linear(gate, packed[4 * l + 3], biases[4 * l + 3]);
    if (!out_norms.empty() && out_norms[2 * l + 1].has_value()) down = rms_norm(down, *out_norms[2 * l + 1], eps);
    if (l + 1 == layers)
      x.add_(down);
    else
      h = add_rms_norm(x, down, norms[2 * (l + 1)], eps);
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers", &decode_layers);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_qk_cache", &rope_qk_cache);
  m.def("attention", &attention);
  m.def("silu_mul", &silu_mul);
  m.def("gelu_tanh_mul", &gelu_tanh_mul);
  m.def("attention_bf16_dots", [](bool on) { bf16_attention_dots = on; });
  m.def("tile_linear_available", &tile_linear_available);
  m.def("tile_linear_kernel", &tile_linear_kernel);
  m.def("prefer_amx", &prefer_amx);
  m.def("tile_pack", &tile_pack);
  m.def("tile_linear", &tile_linear);
  m.def("rows_linear_kernel", &rows_linear_kernel);
  m.def("rows_pack", &rows_pack);
  m.def("rows_linear", &rows_linear);
  m.def("quant_linear_kernel", &quant_linear_kernel);
  m.def("quant_linear_tiles", &quant_linear_tiles);
  m.def("quant_linear", &quant_linear);
  m.def("quant_linear_parts", &quant_linear_parts);
  m.def("quant_pack", &quant_pack_native);
  m.def("quant_rows", &quant_rows);
}
