// attnserve::dropout's CPU kernel: element i is kept where the top 16 bits of a hash of (seed, i) are at
// least p * 65536 (rounded), then scaled by the inverse of the kept fraction. The mask is a pure function of the seed, so the backward
// recomputes it instead of keeping it, and the work spreads over the cores; torch's CPU bernoulli draws
// from one serial generator on hosts where it does not use MKL. 32-bit integer hashing, 8 lanes with AVX2
// (picked at run time), plain C++ elsewhere; both give the same bits. Semantics: model/dropout.py.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

namespace {

constexpr uint32_t GOLDEN = 0x9E3779B9u;

inline uint32_t fmix32(uint32_t h) {  // MurmurHash3's finaliser
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

inline uint32_t hash(uint32_t i, uint32_t k1, uint32_t k2) { return fmix32(fmix32(i * GOLDEN + k1) ^ k2); }

struct Params {
  uint32_t k1, k2, threshold;
  double scale;  // 65536 / (65536 - threshold): the mean is kept exactly at the kept fraction used
};

template <typename T>
void run_scalar(const T* x, T* y, int64_t begin, int64_t end, const Params& q) {
  using acc_t = at::opmath_type<T>;  // float for the narrow types, double for double
  const auto scale = static_cast<acc_t>(q.scale);
  for (int64_t i = begin; i < end; ++i) {
    const bool keep = (hash(static_cast<uint32_t>(i), q.k1, q.k2) >> 16) >= q.threshold;
    y[i] = static_cast<T>(static_cast<acc_t>(x[i]) * (keep ? scale : acc_t(0)));
  }
}

__attribute__((target("avx2"))) inline __m256i fmix32_8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// the multipliers (scale or 0) of elements i .. i + 7
__attribute__((target("avx2"))) inline __m256 multipliers8(int64_t i, const Params& q) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(i))),
                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i h = _mm256_add_epi32(_mm256_mullo_epi32(idx, _mm256_set1_epi32(static_cast<int>(GOLDEN))),
                               _mm256_set1_epi32(static_cast<int>(q.k1)));
  h = fmix32_8(_mm256_xor_si256(fmix32_8(h), _mm256_set1_epi32(static_cast<int>(q.k2))));
  // top 16 bits >= threshold; both sides below 2^16 + 1, so the signed compare is exact
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_srli_epi32(h, 16),
                                          _mm256_set1_epi32(static_cast<int>(q.threshold) - 1));
  return _mm256_and_ps(_mm256_castsi256_ps(keep), _mm256_set1_ps(static_cast<float>(q.scale)));
}

__attribute__((target("avx2"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2"))) inline __m256 load8(const at::BFloat16* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

__attribute__((target("avx2"))) inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
__attribute__((target("avx2"))) inline void store8(at::BFloat16* p, __m256 v) {
  // round to nearest even, NaN to 0x7FC0: as c10::BFloat16's conversion
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

template <typename T>
__attribute__((target("avx2"))) void run_avx2(const T* x, T* y, int64_t begin, int64_t end, const Params& q) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    store8(y + i, _mm256_mul_ps(load8(x + i), multipliers8(i, q)));
  }
  run_scalar(x, y, i, end, q);
}

// ATTNSERVE_ISA=scalar turns the vector path off, as for the other kernels
bool use_avx2() {
  __builtin_cpu_init();
  const char* cap = std::getenv("ATTNSERVE_ISA");
  return !(cap && std::string(cap) == "scalar") && __builtin_cpu_supports("avx2");
}

template <typename T>
void run(const T* x, T* y, int64_t n, const Params& q) {
  static const bool avx2 = use_avx2();
  at::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
      if (avx2) {
        run_avx2(x, y, begin, end, q);
        return;
      }
    }
    run_scalar(x, y, begin, end, q);
  });
}

at::Tensor dropout(const at::Tensor& x, double p, int64_t seed) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "attnserve::dropout: p must be in [0, 1), got ", p);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const auto s = static_cast<uint64_t>(seed);
  const auto threshold = static_cast<uint32_t>(std::lround(p * 65536.0));
  TORCH_CHECK(threshold < 65536, "attnserve::dropout: p rounds to 1, got ", p);
  const Params q{static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32), threshold,
                 65536.0 / (65536.0 - threshold)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "attnserve_dropout", [&] {
    run<scalar_t>(xc.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), xc.numel(), q);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(attnserve, CPU, m) {
  m.impl("dropout", dropout);
}
