// attnserve::int4_linear's and attnserve::q8_linear's CPU kernels: 4-bit weights in groups of 32 along K,
// each group with an fp16 scale and minimum (llama.cpp's Q4_1), or 8-bit ones with a scale (its Q8_0),
// times activations quantized to int8 per row and group (as llama.cpp quantizes them). At a few rows a
// decode step streams its weights once, so the bytes are most of the cost; the integer dot products run
// on AVX-512 VNNI (int4) or AVX2, picked at run time, so one build serves every x86 host. Layouts:
// model/quantize.py (`pack_int4`, `pack_q8`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t G = 32;                 // weights per group along K
constexpr int64_t NB = 16;                // outputs per block
constexpr int64_t NIBBLES = NB * G / 2;   // 256 bytes of 4-bit weights per (block, group)
constexpr int64_t BLOCK = NIBBLES + 2 * NB * 2;  // + 16 fp16 scales + 16 fp16 minima = 320 bytes
constexpr int64_t Q8_BYTES = NB * G;      // 512 bytes of int8 weights per (block, group)
constexpr int64_t Q8_BLOCK = Q8_BYTES + NB * 2;  // + 16 fp16 scales = 544 bytes
constexpr int64_t ROWS = 8;               // rows sharing one unpacking of a group's weights
// Software prefetch this far ahead of the group being read: the hardware prefetcher alone leaves the
// stream of weights latency-bound (docs/decisions.md, "int4 weight prefetch")
constexpr int64_t PREFETCH_BYTES = 8192;

template <int64_t Bytes = BLOCK>
inline void prefetch_group(const uint8_t* w) {
  const char* p = reinterpret_cast<const char*>(w) + PREFETCH_BYTES;
  for (int64_t c = 0; c < Bytes; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
}

struct Acts {
  int64_t m, k, groups;
  std::vector<int8_t> q;      // (M, K)
  std::vector<float> scale;   // (M, K/G)
  std::vector<float> sum;     // (M, K/G): scale * sum of the group's q, what the group minimum multiplies
};

void quantize_row_scalar(const float* x, int64_t k, int8_t* q, float* scale, float* sum) {
  for (int64_t g = 0; g < k / G; ++g) {
    const float* xg = x + g * G;
    float amax = 0.f;
    for (int64_t i = 0; i < G; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int32_t s = 0;
    for (int64_t i = 0; i < G; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xg[i] * inv));
      q[g * G + i] = static_cast<int8_t>(std::min(127, std::max(-127, v)));
      s += q[g * G + i];
    }
    scale[g] = d;
    sum[g] = d * static_cast<float>(s);
  }
}

__attribute__((target("avx512f,avx512bw,avx512dq")))
void quantize_row_avx512(const float* x, int64_t k, int8_t* q, float* scale, float* sum) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t g = 0; g < k / G; ++g) {
    const __m512 a = _mm512_loadu_ps(x + g * G), b = _mm512_loadu_ps(x + g * G + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vi));  // round to nearest even, as nearbyint
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * G), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * G + 16), _mm512_cvtsepi32_epi8(qb));
    scale[g] = d;
    sum[g] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
}

__attribute__((target("avx2,fma")))
void quantize_row_avx2(const float* x, int64_t k, int8_t* q, float* scale, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t g = 0; g < k / G; ++g) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + g * G + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m256 vi = _mm256_set1_ps(inv);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vi));  // nearest even
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const __m256i p16 = _mm256_packs_epi32(i32[0], i32[1]), q16 = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, q16), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * G), p8);
    scale[g] = d;
    sum[g] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

// out (M, N) float32 = this block's 16 columns for rows [r0, r0 + R). R is a compile-time constant and
// every loop over registers is unrolled, so weights and accumulators stay in registers.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void block_vnni(const uint8_t* w, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* q = a.q.data();
  const float *scale = a.scale.data(), *sum = a.sum.data();
  for (int64_t g = 0; g < a.groups; ++g, w += BLOCK) {
    prefetch_group(w);
    __m512i W[8];  // W[j]: 16 outputs x the group's inputs 4j..4j+3, one u8 each
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512i L = _mm512_loadu_si512(w + 64 * i);
      W[i] = _mm512_and_si512(L, low);
      W[i + 4] = _mm512_and_si512(_mm512_srli_epi16(L, 4), low);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + NIBBLES)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + NIBBLES + 32)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int32_t* xq = reinterpret_cast<const int32_t*>(q + row * a.k + g * G);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains: half the latency
#pragma GCC unroll 4
      for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, W[j], _mm512_set1_epi32(xq[j]));
        s1 = _mm512_dpbusd_epi32(s1, W[j + 1], _mm512_set1_epi32(xq[j + 1]));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(scale[row * a.groups + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[row * a.groups + g]), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * ldo, acc[r]);
}

template <int R>
__attribute__((target("avx2,fma,f16c")))
void block_avx2(const uint8_t* w0, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* q = a.q.data();
  const float *scale = a.scale.data(), *sum = a.sum.data();
  for (int h = 0; h < 2; ++h) {  // outputs 0-7, then 8-15 of the block
    __m256 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* w = w0;
    for (int64_t g = 0; g < a.groups; ++g, w += BLOCK) {
      if (h == 0) prefetch_group(w);  // the second half re-reads what the first brought in
      __m256i W[8];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256i L = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * i + 32 * h));
        W[i] = _mm256_and_si256(L, low);
        W[i + 4] = _mm256_and_si256(_mm256_srli_epi16(L, 4), low);
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + NIBBLES + 16 * h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + NIBBLES + 32 + 16 * h)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int32_t* xq = reinterpret_cast<const int32_t*>(q + row * a.k + g * G);
        // u8 x s8 pair sums fit int16 (2 * 15 * 127), and so do eight of them: add in 16 bits, widen once
        __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(W[j], _mm256_set1_epi32(xq[j])));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(scale[row * a.groups + g])), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sum[row * a.groups + g]), acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + (r0 + r) * ldo + 8 * h, acc[r]);
  }
}

template <int R>
void block_scalar(const uint8_t* w, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t n = 0; n < NB; ++n) out[(r0 + r) * ldo + n] = 0.f;
  for (int64_t g = 0; g < a.groups; ++g, w += BLOCK) {
    for (int64_t n = 0; n < NB; ++n) {
      int32_t qw[G];
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 4; ++t) {
          const uint8_t b = w[64 * i + 4 * n + t];
          qw[4 * i + t] = b & 0x0F;
          qw[16 + 4 * i + t] = b >> 4;
        }
      at::Half dh, mh;
      std::memcpy(&dh, w + NIBBLES + 2 * n, 2);
      std::memcpy(&mh, w + NIBBLES + 32 + 2 * n, 2);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int8_t* xq = a.q.data() + row * a.k + g * G;
        int32_t s = 0;
        for (int64_t i = 0; i < G; ++i) s += qw[i] * xq[i];
        out[row * ldo + n] += static_cast<float>(s) * (static_cast<float>(dh) * a.scale[row * a.groups + g]) +
                              static_cast<float>(mh) * a.sum[row * a.groups + g];
      }
    }
  }
}

// Q8: 32 bytes hold outputs 8h..8h+7 x inputs 4j..4j+3 of a group (chunk j of half h). s8 x s8 products
// go through maddubs as |w| x (x with w's sign): pair sums fit int16 (2 * 127 * 127), and widen at once.
template <int R>
__attribute__((target("avx2,fma,f16c")))
void q8_block_avx2(const uint8_t* w0, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* q = a.q.data();
  const float* scale = a.scale.data();
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* w = w0;
    for (int64_t g = 0; g < a.groups; ++g, w += Q8_BLOCK) {
      if (h == 0) prefetch_group<Q8_BLOCK>(w);
      __m256i W[8], A[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        W[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * (8 * h + j)));
        A[j] = _mm256_abs_epi8(W[j]);
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + Q8_BYTES + 16 * h)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int32_t* xq = reinterpret_cast<const int32_t*>(q + row * a.k + g * G);
        __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m256i p = _mm256_maddubs_epi16(A[j], _mm256_sign_epi8(_mm256_set1_epi32(xq[j]), W[j]));
          s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(scale[row * a.groups + g])),
                                 acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + (r0 + r) * ldo + 8 * h, acc[r]);
  }
}

template <int R>
void q8_block_scalar(const uint8_t* w, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t n = 0; n < NB; ++n) out[(r0 + r) * ldo + n] = 0.f;
  for (int64_t g = 0; g < a.groups; ++g, w += Q8_BLOCK) {
    const int8_t* qw = reinterpret_cast<const int8_t*>(w);
    for (int64_t n = 0; n < NB; ++n) {
      at::Half dh;
      std::memcpy(&dh, w + Q8_BYTES + 2 * n, 2);
      const int64_t h = n / 8, o = n % 8;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int8_t* xq = a.q.data() + row * a.k + g * G;
        int32_t s = 0;
        for (int64_t j = 0; j < 8; ++j)
          for (int64_t t = 0; t < 4; ++t) s += qw[32 * (8 * h + j) + 4 * o + t] * xq[4 * j + t];
        out[row * ldo + n] += static_cast<float>(s) * (static_cast<float>(dh) * a.scale[row * a.groups + g]);
      }
    }
  }
}

using BlockFn = void (*)(const uint8_t*, const Acts&, int64_t, float*, int64_t);
using Blocks = std::array<BlockFn, ROWS + 1>;  // by rows in the register block, 1..ROWS

#define ATTNSERVE_BLOCKS(fn) Blocks{nullptr, fn<1>, fn<2>, fn<3>, fn<4>, fn<5>, fn<6>, fn<7>, fn<8>}

using QuantizeFn = void (*)(const float*, int64_t, int8_t*, float*, float*);

struct Isa {
  Blocks block, q8_block;
  QuantizeFn quantize;
  bool avx512;
};

// ATTNSERVE_ISA=avx2 or =scalar caps the choice (tests run every path on one host)
Isa pick() {
  __builtin_cpu_init();
  const char* cap = std::getenv("ATTNSERVE_ISA");
  const std::string want = cap ? cap : "";
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq");
  const Blocks q8_scalar = ATTNSERVE_BLOCKS(q8_block_scalar);
  if (want == "scalar") return {ATTNSERVE_BLOCKS(block_scalar), q8_scalar, quantize_row_scalar, false};
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const Blocks q8 = avx2 ? ATTNSERVE_BLOCKS(q8_block_avx2) : q8_scalar;
  if (want != "avx2" && avx512 && __builtin_cpu_supports("avx512vnni"))
    return {ATTNSERVE_BLOCKS(block_vnni), q8, quantize_row_avx512, true};
  if (avx2) return {ATTNSERVE_BLOCKS(block_avx2), q8, quantize_row_avx2, avx512 && want != "avx2"};
  return {ATTNSERVE_BLOCKS(block_scalar), q8_scalar, quantize_row_scalar, avx512 && want != "avx2"};
}

__attribute__((target("avx512f,avx512bw")))
void to_bf16_avx512(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // round to nearest even, as c10::BFloat16 does for finite values
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
  for (; i < n; ++i) dst[i] = at::BFloat16(src[i]);
}

// x (M, K) times weights packed in blocks of `bytes` per (16 outputs, group) -> (M, N), in x's dtype
at::Tensor grouped_linear(const char* name, const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                          int64_t bytes, bool q8) {
  static const Isa isa = pick();
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == bytes && packed.scalar_type() == at::kByte,
              "attnserve::", name, ": packed weights must be uint8 (N/16, K/32, ", bytes, ")");
  TORCH_CHECK(packed.size(0) * NB == out_features, "attnserve::", name, ": packed for ", packed.size(0) * NB,
              " outputs, asked for ", out_features);
  const int64_t k = packed.size(1) * G;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "attnserve::", name, ": x must be (M, ", k, ")");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "attnserve::", name, ": x must be float32 or bfloat16");
  const Blocks& block = q8 ? isa.q8_block : isa.block;
  const at::Tensor xc = x.contiguous(), w = packed.contiguous();
  // scratch reused across calls: a decode step makes ~120 of them, each a few microseconds
  thread_local Acts a;
  thread_local std::vector<float> xrow, yf;
  a.m = x.size(0), a.k = k, a.groups = k / G;
  a.q.resize(a.m * k);
  a.scale.resize(a.m * a.groups);
  a.sum.resize(a.m * a.groups);
  xrow.resize(k);
  for (int64_t r = 0; r < a.m; ++r) {
    const float* row = xrow.data();
    if (bf16) {
      const at::BFloat16* xb = xc.data_ptr<at::BFloat16>() + r * k;
      for (int64_t i = 0; i < k; ++i) xrow[i] = static_cast<float>(xb[i]);
    } else {
      row = xc.data_ptr<float>() + r * k;
    }
    isa.quantize(row, k, a.q.data() + r * k, a.scale.data() + r * a.groups, a.sum.data() + r * a.groups);
  }
  at::Tensor y = at::empty({a.m, out_features}, x.options());
  if (bf16) yf.resize(a.m * out_features);
  float* yp = bf16 ? yf.data() : y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const Acts& acts = a;
  at::parallel_for(0, packed.size(0), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r0 = 0; r0 < acts.m; r0 += ROWS)
        block[std::min(ROWS, acts.m - r0)](wp + b * acts.groups * bytes, acts, r0, yp + b * NB, out_features);
  });
  if (bf16) {
    at::BFloat16* yb = y.data_ptr<at::BFloat16>();
    if (isa.avx512) {
      to_bf16_avx512(yp, yb, a.m * out_features);
    } else {
      for (int64_t i = 0; i < a.m * out_features; ++i) yb[i] = at::BFloat16(yp[i]);
    }
  }
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return grouped_linear("int4_linear", x, packed, out_features, BLOCK, false);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return grouped_linear("q8_linear", x, packed, out_features, Q8_BLOCK, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnserve, CPU, m) {
  m.impl("int4_linear", int4_linear);
  m.impl("q8_linear", q8_linear);
}
