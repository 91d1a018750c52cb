// The vector types of the kernels, CPU and CUDA: Vec, N elements accessed as one unit, and Word, the machine word
// of a number of bytes, through which a device access of a Vec (or of raw bytes) is one load or store.
#pragma once
#include <cstdint>

namespace packcuda {

// N consecutive elements of T, aligned to ALIGN bytes: by default their whole size, so that a device access of
// an aligned one can be a single vector load or store; less for element-aligned data (ALIGN = sizeof(T)).
template <typename T, int N, int ALIGN = static_cast<int>(sizeof(T)) * N>
struct alignas(ALIGN) Vec {
  T v[N];
};

// The machine word of B bytes, so that a device access is a single (vector) load or store: a struct-of-structs
// copy may be split into one access per element.
template <int B> struct Word;
template <> struct Word<1> { using type = uint8_t; };
template <> struct Word<2> { using type = uint16_t; };
template <> struct Word<4> { using type = uint32_t; };
#if defined(__CUDACC__)
template <> struct Word<8> { using type = uint2; };
template <> struct Word<16> { using type = uint4; };
#endif

}  // namespace packcuda
