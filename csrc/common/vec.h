// The vector types of the kernels, CPU and CUDA: Vec, N elements accessed as one unit; Word, the machine word of a
// number of bytes, through which a device access of a Vec (or of raw bytes) is one load or store; the row loads
// and stores built on them (load_vec / store_vec / zero_vec); PC_UNROLL for their fixed-trip loops.
#pragma once
#include <cstdint>

#include "dtype.h"
#include "hd.h"

#if defined(__CUDACC__)
#define PC_UNROLL _Pragma("unroll")
#else
#define PC_UNROLL
#endif

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
template <> struct Word<1> {
  using type = uint8_t;
};
template <> struct Word<2> {
  using type = uint16_t;
};
template <> struct Word<4> {
  using type = uint32_t;
};
#if defined(__CUDACC__)
template <> struct Word<8> {
  using type = uint2;
};
template <> struct Word<16> {
  using type = uint4;
};
#endif

// V consecutive channels of one token row, loaded / stored as one access (16 bytes on the CUDA vector path: the
// row pointer must then be aligned to sizeof(Vec)). V = 1 is a plain element.
#if defined(__CUDACC__)
template <typename S, int V> union VecWord {  // a Vec and its machine word (device accesses go through w)
  typename Word<sizeof(Vec<S, V>)>::type w;
  Vec<S, V> v;
};
#endif
template <int V, typename S> PC_HD Vec<S, V> load_vec(const S* p) {
  Vec<S, V> r;
  if constexpr (V == 1) {
    r.v[0] = p[0];
  } else {
#if defined(__CUDA_ARCH__)
    VecWord<S, V> u;
    u.w = *reinterpret_cast<const decltype(u.w)*>(p);
    r = u.v;
#else
    r = *reinterpret_cast<const Vec<S, V>*>(p);
#endif
  }
  return r;
}
// store_vec writes global memory only (the outputs).
template <int V, typename S> PC_HD void store_vec(S* p, const Vec<S, V>& r) {
  if constexpr (V == 1) {
    p[0] = r.v[0];
  } else {
#if defined(__CUDA_ARCH__)
    VecWord<S, V> u;
    u.v = r;
    __stwb(reinterpret_cast<decltype(u.w)*>(p), u.w);  // global memory: one vector store
#else
    *reinterpret_cast<Vec<S, V>*>(p) = r;
#endif
  }
}
template <int V, typename S> PC_HD Vec<S, V> zero_vec() {
  using A = typename Acc<S>::type;
  Vec<S, V> r;
  PC_UNROLL
  for (int v = 0; v < V; ++v) r.v[v] = from_acc<S>(A(0));
  return r;
}

}  // namespace packcuda
