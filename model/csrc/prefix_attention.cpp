// attnserve::prefix_attention's CPU kernel: one new query per row over its cached prefix (a strided view
// of the slot cache, keys a mask allows) plus its own new key, in one pass per (row, K/V head). Batched
// matmuls would copy the strided prefix first and pay oneDNN's set-up twice a layer, which at a few rows
// costs more than the arithmetic. Query heads that share a K/V head read each key once. Sums in float32;
// AVX-512 or AVX2 picked at run time, plain C++ elsewhere. Semantics: model/attention.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr int MAX_G = 8;    // query heads per K/V head with a vector path
constexpr int MAX_D = 256;  // head size with a vector path

// One (row, K/V head), everything already float32 except the cached keys and values (T): q (G, D)
// pre-scaled, the row's own key and value (D,), the mask (L,), out (G, D).
template <typename T>
struct Head {
  const float* q;
  const T* k;
  const T* v;
  int64_t ks, vs;  // key / value row strides in elements
  const float* k_own;
  const float* v_own;
  const bool* ok;
  int64_t length, d;
  float* out;
};

// Keys past the last one the mask allows are skipped: rows shorter than the step's longest read a view as
// long as that one's. The row's own key takes the score after the live ones.
inline int64_t live_keys(const bool* ok, int64_t length) {
  while (length > 0 && !ok[length - 1]) --length;
  return length;
}

// Keys this far ahead are fetched while the current ones are summed, and each key's value row is fetched
// for the second pass: a row's prefix is too short a stream for the hardware prefetcher to ramp up
constexpr int64_t PREFETCH_KEYS = 16;

template <typename T>
inline void prefetch_keys(const Head<T>& h, int64_t j, int64_t count) {
  for (int64_t t = 0; t < count; ++t) {
    const char* kp = reinterpret_cast<const char*>(h.k + (j + t + PREFETCH_KEYS) * h.ks);
    const char* vp = reinterpret_cast<const char*>(h.v + (j + t) * h.vs);
    for (int64_t b = 0; b < h.d * static_cast<int64_t>(sizeof(T)); b += 64) {
      _mm_prefetch(kp + b, _MM_HINT_T0);
      _mm_prefetch(vp + b, _MM_HINT_T0);
    }
  }
}

// softmax over scores (G, L + 1) in place, masked keys at -inf; the own key (last) is always attended
void softmax_rows(float* s, int64_t g, int64_t n) {
  for (int64_t h = 0; h < g; ++h) {
    float* row = s + h * n;
    float mx = row[n - 1];
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += (row[j] = std::exp(row[j] - mx));
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
  }
}

template <typename T>
void head_scalar(const Head<T>& h, int64_t g, float* s) {
  const int64_t n = h.length + 1, d = h.d;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t a = 0; a < g; ++a) {
      float dot = 0.f;
      if (j == h.length) {
        for (int64_t i = 0; i < d; ++i) dot += h.q[a * d + i] * h.k_own[i];
      } else if (h.ok[j]) {
        for (int64_t i = 0; i < d; ++i) dot += h.q[a * d + i] * static_cast<float>(h.k[j * h.ks + i]);
      } else {
        dot = -std::numeric_limits<float>::infinity();
      }
      s[a * n + j] = dot;
    }
  }
  softmax_rows(s, g, n);
  for (int64_t a = 0; a < g; ++a) {
    float* o = h.out + a * d;
    for (int64_t i = 0; i < d; ++i) o[i] = s[a * n + h.length] * h.v_own[i];
    for (int64_t j = 0; j < h.length; ++j) {
      const float p = s[a * n + j];
      if (p == 0.f) continue;
      for (int64_t i = 0; i < d; ++i) o[i] += p * static_cast<float>(h.v[j * h.vs + i]);
    }
  }
}

__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const at::BFloat16* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// exp(x) for x <= 0 (scores minus their maximum), Cephes' polynomial; below -87 it returns ~1e-38, not 0:
// masked keys are skipped when values are summed, so their tiny weights only touch the sum, negligibly
#define ATTNSERVE_EXP_BODY(V, set1, mul, add, fmadd, round, cvt_int, pow2)                              \
  x = V##_max_ps(x, set1(-87.0f));                                                                     \
  const auto n = round(mul(x, set1(1.44269504f)));                                                     \
  x = fmadd(n, set1(-0.693359375f), x);                                                                \
  x = fmadd(n, set1(2.12194440e-4f), x);                                                               \
  auto p = set1(1.9875691500e-4f);                                                                     \
  p = fmadd(p, x, set1(1.3981999507e-3f));                                                             \
  p = fmadd(p, x, set1(8.3334519073e-3f));                                                             \
  p = fmadd(p, x, set1(4.1665795894e-2f));                                                             \
  p = fmadd(p, x, set1(1.6666665459e-1f));                                                             \
  p = fmadd(p, x, set1(5.0000001201e-1f));                                                             \
  p = fmadd(p, mul(x, x), add(x, set1(1.f)));                                                          \
  return mul(p, pow2(cvt_int(n)));

__attribute__((target("avx512f,avx512bw"))) inline __m512 pow2_512(__m512i n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
}
__attribute__((target("avx512f,avx512bw"))) inline __m512 round_512(__m512 x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
__attribute__((target("avx512f,avx512bw"))) inline __m512 exp_512(__m512 x) {
  ATTNSERVE_EXP_BODY(_mm512, _mm512_set1_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_fmadd_ps, round_512,
                     _mm512_cvtps_epi32, pow2_512)
}

__attribute__((target("avx512f,avx512bw")))
void softmax_512(float* s, int64_t g, int64_t stride, int64_t n) {  // n of each row's stride
  for (int64_t h = 0; h < g; ++h) {
    float* row = s + h * stride;
    __m512 mx = _mm512_set1_ps(row[n - 1]);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + j));
    float m = _mm512_reduce_max_ps(mx);
    for (; j < n; ++j) m = std::max(m, row[j]);
    const __m512 vm = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < n; j += 16) {
      const __mmask16 live = j + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 e = exp_512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row + j), vm));
      _mm512_mask_storeu_ps(row + j, live, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, e));
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    for (j = 0; j < n; j += 16) {
      const __mmask16 live = j + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      _mm512_mask_storeu_ps(row + j, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, row + j), inv));
    }
  }
}

// Slices of D summed in one pass over the values: about 12 accumulators in 32 vector registers
constexpr int slices_per_pass(int g) { return g <= 3 ? 4 : (g <= 6 ? 2 : 1); }

// G query heads share each key and value load; D a multiple of 16
template <typename T, int G>
__attribute__((target("avx512f,avx512bw")))
void head_avx512(const Head<T>& h, float* s) {
  constexpr int64_t W = 16;
  const int64_t n = h.length + 1, c = h.d / W, live = live_keys(h.ok, h.length);
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  if constexpr (G <= 4) {  // four keys at a time, their sums reduced together (one reduction per key is slow)
    for (; j + 4 <= live; j += 4) {
      prefetch_keys(h, j, 4);
      __m512 acc[G][4];
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a)
        for (int t = 0; t < 4; ++t) acc[a][t] = _mm512_setzero_ps();
      for (int64_t i = 0; i < c; ++i) {
        __m512 kv[4];
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) kv[t] = load16(h.k + (j + t) * h.ks + i * W);
#pragma GCC unroll 8
        for (int a = 0; a < G; ++a) {
          const __m512 qa = _mm512_loadu_ps(h.q + a * h.d + i * W);
#pragma GCC unroll 4
          for (int t = 0; t < 4; ++t) acc[a][t] = _mm512_fmadd_ps(qa, kv[t], acc[a][t]);
        }
      }
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a) {  // per 128-bit lane: [k0, k1, k2, k3] partial sums, then lanes added
        const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(acc[a][0], acc[a][1]), _mm512_unpackhi_ps(acc[a][0], acc[a][1]));
        const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(acc[a][2], acc[a][3]), _mm512_unpackhi_ps(acc[a][2], acc[a][3]));
        const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
        const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(u),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
        _mm_storeu_ps(s + a * n + j, _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1)));
        for (int t = 0; t < 4; ++t)
          if (!h.ok[j + t]) s[a * n + j + t] = ninf;
      }
    }
  }
  for (; j <= live; ++j) {  // the last few keys, then the row's own key (its score at index `live`)
    const bool own = j == live;
    if (!own && !h.ok[j]) {
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a) s[a * n + j] = ninf;
      continue;
    }
    __m512 acc[G];
#pragma GCC unroll 8
    for (int a = 0; a < G; ++a) acc[a] = _mm512_setzero_ps();
    for (int64_t i = 0; i < c; ++i) {
      const __m512 kv = own ? _mm512_loadu_ps(h.k_own + i * W) : load16(h.k + j * h.ks + i * W);
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a) acc[a] = _mm512_fmadd_ps(_mm512_loadu_ps(h.q + a * h.d + i * W), kv, acc[a]);
    }
#pragma GCC unroll 8
    for (int a = 0; a < G; ++a) s[a * n + j] = _mm512_reduce_add_ps(acc[a]);
  }
  softmax_512(s, G, n, live + 1);
  // SL 16-wide slices of D at a time, G x SL accumulators over every key: one FMA chain per accumulator
  // would wait on its own latency at every key, SL x G independent ones keep the FMA units busy
  constexpr int SL = slices_per_pass(G);
  for (int64_t i0 = 0; i0 < c; i0 += SL) {
    __m512 o[G][SL];
#pragma GCC unroll 8
    for (int t = 0; t < SL; ++t) {
      const __m512 vo = i0 + t < c ? _mm512_loadu_ps(h.v_own + (i0 + t) * W) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a) o[a][t] = _mm512_mul_ps(_mm512_set1_ps(s[a * n + live]), vo);
    }
    for (int64_t j = 0; j < live; ++j) {
      if (!h.ok[j]) continue;
#pragma GCC unroll 8
      for (int t = 0; t < SL; ++t) {
        if (i0 + t >= c) break;
        const __m512 vv = load16(h.v + j * h.vs + (i0 + t) * W);
#pragma GCC unroll 8
        for (int a = 0; a < G; ++a) o[a][t] = _mm512_fmadd_ps(_mm512_set1_ps(s[a * n + j]), vv, o[a][t]);
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < SL; ++t) {
      if (i0 + t >= c) break;
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a) _mm512_storeu_ps(h.out + a * h.d + (i0 + t) * W, o[a][t]);
    }
  }
}

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const at::BFloat16* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) inline __m256 pow2_256(__m256i n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
__attribute__((target("avx2,fma"))) inline __m256 round_256(__m256 x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
__attribute__((target("avx2,fma"))) inline __m256 exp_256(__m256 x) {
  ATTNSERVE_EXP_BODY(_mm256, _mm256_set1_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_fmadd_ps, round_256,
                     _mm256_cvtps_epi32, pow2_256)
}

__attribute__((target("avx2,fma")))
void softmax_256(float* s, int64_t g, int64_t stride, int64_t n) {  // n of each row's stride
  for (int64_t h = 0; h < g; ++h) {
    float* row = s + h * stride;
    float m = row[n - 1];
    for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 e = exp_256(_mm256_sub_ps(_mm256_loadu_ps(row + j), vm));
      _mm256_storeu_ps(row + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = hsum8(sum);
    for (; j < n; ++j) total += (row[j] = std::exp(row[j] - m));
    const float inv = 1.f / total;
    for (j = 0; j < n; ++j) row[j] *= inv;
  }
}

// keys per pass of the score loop: G x KB accumulators, G query slices and one key slice in 16 registers
constexpr int keys_per_pass_256(int g) { return g <= 3 ? 4 : (g <= 5 ? 2 : 1); }

// sums of KB accumulators (8 lanes each) -> KB floats at dst
template <int KB>
__attribute__((target("avx2,fma"))) inline void store_sums(const __m256* acc, float* dst) {
  if constexpr (KB == 1) {
    dst[0] = hsum8(acc[0]);
  } else {
    const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]);
    __m256 t1 = t0;
    if constexpr (KB == 4) t1 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 t2 = _mm256_hadd_ps(t0, t1);  // per 128-bit lane: [k0, k1, k2, k3] partial sums
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1));
    if constexpr (KB == 4) {
      _mm_storeu_ps(dst, r);
    } else {
      _mm_storel_pi(reinterpret_cast<__m64*>(dst), r);
    }
  }
}

// as head_avx512, 8 wide, with 16 registers: G x KB score accumulators (KB keys at a time) and G x SL
// output slices per pass; D a multiple of 8
constexpr int slices_per_pass_256(int g) { return g <= 1 ? 8 : (g <= 3 ? 4 : (g <= 5 ? 2 : 1)); }

template <typename T, int G>
__attribute__((target("avx2,fma")))
void head_avx2(const Head<T>& h, float* s) {
  constexpr int64_t W = 8;
  constexpr int KB = keys_per_pass_256(G), SL = slices_per_pass_256(G);
  const int64_t n = h.length + 1, c = h.d / W, live = live_keys(h.ok, h.length);
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + KB <= live; j += KB) {
    prefetch_keys(h, j, KB);
    __m256 acc[G][KB];
#pragma GCC unroll 8
    for (int a = 0; a < G; ++a)
#pragma GCC unroll 4
      for (int t = 0; t < KB; ++t) acc[a][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < c; ++i) {
      __m256 qa[G];
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a) qa[a] = _mm256_loadu_ps(h.q + a * h.d + i * W);
#pragma GCC unroll 4
      for (int t = 0; t < KB; ++t) {
        const __m256 kv = load8(h.k + (j + t) * h.ks + i * W);
#pragma GCC unroll 8
        for (int a = 0; a < G; ++a) acc[a][t] = _mm256_fmadd_ps(qa[a], kv, acc[a][t]);
      }
    }
#pragma GCC unroll 8
    for (int a = 0; a < G; ++a) {
      store_sums<KB>(acc[a], s + a * n + j);
#pragma GCC unroll 4
      for (int t = 0; t < KB; ++t)
        if (!h.ok[j + t]) s[a * n + j + t] = ninf;
    }
  }
  for (; j <= live; ++j) {  // the last few keys, then the row's own key (its score at index `live`)
    const bool own = j == live;
    if (!own && !h.ok[j]) {
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a) s[a * n + j] = ninf;
      continue;
    }
    __m256 acc[G];
#pragma GCC unroll 8
    for (int a = 0; a < G; ++a) acc[a] = _mm256_setzero_ps();
    for (int64_t i = 0; i < c; ++i) {
      const __m256 kv = own ? _mm256_loadu_ps(h.k_own + i * W) : load8(h.k + j * h.ks + i * W);
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a) acc[a] = _mm256_fmadd_ps(_mm256_loadu_ps(h.q + a * h.d + i * W), kv, acc[a]);
    }
#pragma GCC unroll 8
    for (int a = 0; a < G; ++a) s[a * n + j] = hsum8(acc[a]);
  }
  softmax_256(s, G, n, live + 1);
  for (int64_t i0 = 0; i0 < c; i0 += SL) {
    __m256 o[G][SL];
#pragma GCC unroll 8
    for (int t = 0; t < SL; ++t) {
      const __m256 vo = i0 + t < c ? _mm256_loadu_ps(h.v_own + (i0 + t) * W) : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a) o[a][t] = _mm256_mul_ps(_mm256_set1_ps(s[a * n + live]), vo);
    }
    for (int64_t j = 0; j < live; ++j) {
      if (!h.ok[j]) continue;
      __m256 p[G];
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a) p[a] = _mm256_set1_ps(s[a * n + j]);
#pragma GCC unroll 8
      for (int t = 0; t < SL; ++t) {
        if (i0 + t >= c) break;
        const __m256 vv = load8(h.v + j * h.vs + (i0 + t) * W);
#pragma GCC unroll 8
        for (int a = 0; a < G; ++a) o[a][t] = _mm256_fmadd_ps(p[a], vv, o[a][t]);
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < SL; ++t) {
      if (i0 + t >= c) break;
#pragma GCC unroll 8
      for (int a = 0; a < G; ++a) _mm256_storeu_ps(h.out + a * h.d + (i0 + t) * W, o[a][t]);
    }
  }
}

enum class Path { scalar, avx2, avx512 };

// ATTNSERVE_ISA=avx2 or =scalar caps the choice, as for int4_linear
Path pick() {
  __builtin_cpu_init();
  const char* cap = std::getenv("ATTNSERVE_ISA");
  const std::string want = cap ? cap : "";
  if (want == "scalar") return Path::scalar;
  if (want != "avx2" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return Path::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Path::avx2;
  return Path::scalar;
}

template <typename T>
using HeadFn = void (*)(const Head<T>&, float*);

#define ATTNSERVE_HEADS(fn) \
  { nullptr, fn<T, 1>, fn<T, 2>, fn<T, 3>, fn<T, 4>, fn<T, 5>, fn<T, 6>, fn<T, 7>, fn<T, 8> }

template <typename T>
void run_head(Path path, const Head<T>& h, int64_t g, float* s) {
  static const HeadFn<T> avx512[MAX_G + 1] = ATTNSERVE_HEADS(head_avx512);
  static const HeadFn<T> avx2[MAX_G + 1] = ATTNSERVE_HEADS(head_avx2);
  if (g <= MAX_G && h.d <= MAX_D) {
    if (path == Path::avx512 && h.d % 16 == 0) return avx512[g](h, s);
    if (path != Path::scalar && h.d % 8 == 0) return avx2[g](h, s);
  }
  head_scalar<T>(h, g, s);
}

// x (R, heads, 1, D) of any dtype and strides (last dim contiguous) -> float32 rows (G, D) of one unit
template <typename S>
void gather(const at::Tensor& x, int64_t row, int64_t head0, int64_t heads, float mul, float* dst) {
  const S* p = x.data_ptr<S>() + row * x.stride(0) + head0 * x.stride(1);
  const int64_t d = x.size(3);
  for (int64_t a = 0; a < heads; ++a)
    for (int64_t i = 0; i < d; ++i) dst[a * d + i] = static_cast<float>(p[a * x.stride(1) + i]) * mul;
}

void gather_any(const at::Tensor& x, int64_t row, int64_t head0, int64_t heads, float mul, float* dst) {
  if (x.scalar_type() == at::kBFloat16) return gather<at::BFloat16>(x, row, head0, heads, mul, dst);
  gather<float>(x, row, head0, heads, mul, dst);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_new,
         const at::Tensor& v_new, const at::Tensor& ok, at::Tensor& out) {
  static const Path path = pick();
  const int64_t r = q.size(0), h = q.size(1), d = q.size(3), hkv = k.size(1), length = k.size(2), g = h / hkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const bool* okp = ok.data_ptr<bool>();
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  // a (row, K/V head) unit is 2 G L D multiply-adds; fork threads only when each gets ~1e5 of them
  const int64_t grain = std::max<int64_t>(1, 100000 / std::max<int64_t>(1, 2 * g * length * d));
  at::parallel_for(0, r * hkv, grain, [&](int64_t u0, int64_t u1) {
    thread_local std::vector<float> buf;
    buf.resize(g * (length + 1) + 2 * g * d + 2 * d);
    float *s = buf.data(), *qf = s + g * (length + 1), *o = qf + g * d, *own = o + g * d;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t row = u / hkv, kh = u % hkv;
      gather_any(q, row, kh * g, g, scale, qf);
      gather_any(k_new, row, kh, 1, 1.f, own);
      gather_any(v_new, row, kh, 1, 1.f, own + d);
      Head<T> hd{qf, kp + row * k.stride(0) + kh * k.stride(1), vp + row * v.stride(0) + kh * v.stride(1),
                 k.stride(2), v.stride(2), own, own + d, okp + (ok.size(0) == 1 ? 0 : row * ok.stride(0)),
                 length, d, o};
      run_head<T>(path, hd, g, s);
      for (int64_t a = 0; a < g; ++a) {
        const int64_t base = row * out.stride(0) + (kh * g + a) * out.stride(1);
        if (out_bf16) {
          at::BFloat16* dst = out.data_ptr<at::BFloat16>() + base;
          for (int64_t i = 0; i < d; ++i) dst[i] = at::BFloat16(o[a * d + i]);
        } else {
          float* dst = out.data_ptr<float>() + base;
          for (int64_t i = 0; i < d; ++i) dst[i] = o[a * d + i];
        }
      }
    }
  });
}

at::Tensor prefix_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_new,
                            const at::Tensor& v_new, const at::Tensor& prefix_ok) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "attnserve::prefix_attention: q must be (R, H, 1, D)");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), "attnserve::prefix_attention: k, v must be (R, Hkv, L, D)");
  const int64_t r = q.size(0), h = q.size(1), d = q.size(3), hkv = k.size(1), length = k.size(2);
  TORCH_CHECK(k.size(0) == r && k.size(3) == d && h % hkv == 0, "attnserve::prefix_attention: q ", q.sizes(),
              " does not match k ", k.sizes());
  TORCH_CHECK(k_new.dim() == 4 && v_new.dim() == 4 && k_new.size(0) == r && k_new.size(1) == hkv &&
                  k_new.size(2) == 1 && k_new.size(3) == d && v_new.sizes() == k_new.sizes(),
              "attnserve::prefix_attention: k_new, v_new must be (R, Hkv, 1, D)");
  const auto kind = k.scalar_type();
  TORCH_CHECK(v.scalar_type() == kind && (kind == at::kBFloat16 || kind == at::kFloat),
              "attnserve::prefix_attention: k, v must both be bfloat16 or float32");
  for (const at::Tensor* t : {&q, &k_new, &v_new})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 || t->scalar_type() == at::kFloat,
                "attnserve::prefix_attention: q, k_new, v_new must be bfloat16 or float32");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && k_new.stride(3) == 1 &&
                  v_new.stride(3) == 1,
              "attnserve::prefix_attention: the last dimension must be contiguous");
  TORCH_CHECK(prefix_ok.scalar_type() == at::kBool && prefix_ok.dim() == 4 && prefix_ok.size(1) == 1 &&
                  prefix_ok.size(2) == 1 && prefix_ok.size(3) == length &&
                  (prefix_ok.size(0) == r || prefix_ok.size(0) == 1),
              "attnserve::prefix_attention: prefix_ok must be bool (R, 1, 1, L)");
  const at::Tensor ok = prefix_ok.stride(3) == 1 ? prefix_ok : prefix_ok.contiguous();
  at::Tensor out = at::empty({r, h, 1, d}, q.options().dtype(kind));
  if (kind == at::kBFloat16) {
    run<at::BFloat16>(q, k, v, k_new, v_new, ok, out);
  } else {
    run<float>(q, k, v, k_new, v_new, ok, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(attnserve, CPU, m) {
  m.impl("prefix_attention", prefix_attention);
}
