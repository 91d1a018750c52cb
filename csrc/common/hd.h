// Shared host/device index helpers. Every formula that a CPU kernel and a CUDA kernel both need lives in a
// header like this one, so the two backends cannot drift apart.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PC_HD __host__ __device__ __forceinline__
#else
#define PC_HD inline
#endif

namespace packcuda {

// Segment of token t in a cu_seqlens array of n segments (n + 1 non-decreasing entries, cu[0] = 0,
// cu[0] <= t < cu[n]): the i with cu[i] <= t < cu[i + 1]. Zero-length segments are skipped naturally.
template <typename I>
PC_HD int64_t find_segment(const I* cu, int64_t n, int64_t t) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(cu[mid + 1]) <= t) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// The bits of an fp32 value and back (host: memcpy; device: the intrinsic).
PC_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
PC_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// a / b for a >= 0, b > 0, with a 32-bit divide when both fit (a 64-bit divide costs several times more, on CPU
// and GPU alike); the same quotient either way.
PC_HD int64_t div_nonneg(int64_t a, int64_t b) {
  if (((a | b) >> 32) == 0) return static_cast<int64_t>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b));
  return a / b;
}

PC_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
PC_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

}  // namespace packcuda
