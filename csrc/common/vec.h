// Vectors of V consecutive elements of one row, loaded and stored as one access (16 bytes on the CUDA vector
// paths), shared by the kernels of every capability; PC_UNROLL for their fixed-trip loops.
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

// V consecutive channels of one token row, loaded / stored as one access (16 bytes on the CUDA vector path:
// the row pointer must then be aligned to sizeof(Vec)). V = 1 is a plain element.
template <typename S, int V> struct alignas(sizeof(S) * V) Vec {
  S v[V];
};
// One machine word of the Vec's size, so that a device access is a single (vector) load or store: a
// struct-of-structs copy would be split into one access per element.
template <int N> struct Word;
template <> struct Word<2> { using type = unsigned short; };
template <> struct Word<4> { using type = unsigned int; };
#if defined(__CUDACC__)
template <> struct Word<8> { using type = uint2; };
template <> struct Word<16> { using type = uint4; };
#endif
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
