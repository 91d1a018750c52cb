// The element types of the whole library, torch-free and shared by every CPU and CUDA kernel: one enum
// (DType), the 16-bit storage types with their host and device conversions (round to nearest even; the host
// code is exact for every input, subnormals included), the accumulation type of each (fp32, fp64 for fp64),
// and Elem<S>, the load/store pair a kernel uses on an element.
#pragma once
#include <cstdint>

#include "hd.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace packcuda {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2, F64 = 3 };
inline int dtype_size(DType t) { return t == DType::F64 ? 8 : t == DType::F32 ? 4 : 2; }

// 16-bit storage types with host and device conversions (the core does not depend on torch).
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

PC_HD float to_f(float v) { return v; }
PC_HD float to_f(bf16_t v) { return bits_f32(static_cast<uint32_t>(v.bits) << 16); }
PC_HD float to_f(f16_t v) {
#if defined(__CUDA_ARCH__)
  __half_raw r;
  r.x = v.bits;
  return __half2float(__half(r));
#else
  const uint32_t h = v.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);
    // subnormal: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400) == 0);
    man &= 0x3ff;
    return bits_f32(sign | ((127 - 15 - e) << 23) | (man << 13));
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (man << 13));
  return bits_f32(sign | ((exp + 127 - 15) << 23) | (man << 13));
#endif
}

template <typename S> struct From;
template <> struct From<float> {
  static PC_HD float cvt(float v) { return v; }
};
template <> struct From<double> {
  static PC_HD double cvt(double v) { return v; }
};
template <> struct From<bf16_t> {
  static PC_HD bf16_t cvt(float f) {  // round to nearest even, NaN stays NaN
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    __nv_bfloat16_raw r = __nv_bfloat16(__float2bfloat16_rn(f));  // one instruction, the same rounding
    return bf16_t{r.x};
#else
    const uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40)};
    return bf16_t{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
#endif
  }
};
template <> struct From<f16_t> {
  static PC_HD f16_t cvt(float f) {
#if defined(__CUDA_ARCH__)
    __half_raw r = __half(__float2half_rn(f));
    return f16_t{r.x};
#else
    const uint32_t u = f32_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u) return f16_t{static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
    if (au >= 0x477ff000u) return f16_t{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow -> inf
    if (au < 0x38800000u) {  // subnormal or zero in half
      // value = au as float; half subnormal unit = 2^-24
      const float a = bits_f32(au);
      // scale to units of 2^-24 and round to nearest even
      const float scaled = a * 16777216.0f;  // exact (power of two)
      uint32_t q = static_cast<uint32_t>(scaled);
      const float rem = scaled - static_cast<float>(q);
      if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
      return f16_t{static_cast<uint16_t>(sign | q)};
    }
    const uint32_t exp = ((au >> 23) - 127 + 15);
    uint32_t man = au & 0x7fffffu;
    uint32_t h = (exp << 10) | (man >> 13);
    const uint32_t rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carries into the exponent correctly
    return f16_t{static_cast<uint16_t>(sign | h)};
#endif
  }
};
template <typename S, typename A> PC_HD S from_acc(A v) { return From<S>::cvt(v); }

// Accumulation type: fp32 for every storage type except fp64 (which accumulates in fp64).
template <typename S> struct Acc {
  using type = float;
};
template <> struct Acc<double> {
  using type = double;
};
PC_HD float val(float v) { return v; }
PC_HD double val(double v) { return v; }
PC_HD float val(bf16_t v) { return to_f(v); }
PC_HD float val(f16_t v) { return to_f(v); }

// An element's load (to its accumulation type) and store (rounded once to S).
template <typename S> struct Elem {
  using compute = typename Acc<S>::type;
  static PC_HD compute load(S v) { return val(v); }
  static PC_HD S store(compute f) { return From<S>::cvt(f); }
};
// bf16 on the device loads through cuda_bf16's conversion (cvt.f32.bf16 on sm_90), the same value as val's
// shift: with it the rotary and QK-norm kernels' sm_90 code is the code they had on the cuda_bf16 types (the
// shift gives their guarded vector loads other code, and two QK-norm backward kernels more spill). conv and
// exchange convert through val, their code as validated.
template <> struct Elem<bf16_t> {
  using compute = float;
  static PC_HD float load(bf16_t v) {
#if defined(__CUDA_ARCH__)
    __nv_bfloat16_raw r;
    r.x = v.bits;
    return __bfloat162float(__nv_bfloat16(r));
#else
    return val(v);
#endif
  }
  static PC_HD bf16_t store(float f) { return From<bf16_t>::cvt(f); }
};

}  // namespace packcuda
