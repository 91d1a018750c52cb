// Math of the exchange's unpack step (gather_sum), shared by the CPU and CUDA kernels.
#pragma once
#include <cstdint>

#include "../common/dtype.h"
#include "../common/hd.h"
#include "../common/vec.h"

namespace packcuda::exchange {

// Element c of row i of the two-source buffer: a[i] for i < na, b[i - na] above.
template <typename S>
PC_HD const S* source_at(const S* a, int64_t na, const S* b, int64_t i, int64_t C, int64_t c) {
  return i < na ? a + i * C + c : b + (i - na) * C + c;
}

// Two-source gather-sum of rows of C elements: out[r, c] = sum over m < M of src(index[r, m])[c], -1
// contributing nothing (a row with no source is zero). Sums run in the fixed order m = 0..M-1 (deterministic),
// accumulating in fp32 (fp64 for double). V consecutive channels c .. c+V-1 of row r per call (V = 1: one
// element); each channel gets the same scalar sum, V only shares the index reads and widens the loads/stores
// (c and C multiples of V on the vector path).
template <typename S, int V = 1>
PC_HD void gather_sum_elem(S* out, const S* a, int64_t na, const S* b, const int64_t* index, int M, int64_t C,
                           int64_t r, int64_t c) {
  using A = typename Acc<S>::type;
  A acc[V];
  PC_UNROLL
  for (int v = 0; v < V; ++v) acc[v] = A(0);
  for (int m = 0; m < M; ++m) {
    const int64_t i = index[r * M + m];
    if (i < 0) continue;
    const Vec<S, V> x = load_vec<V>(source_at(a, na, b, i, C, c));
    PC_UNROLL
    for (int v = 0; v < V; ++v) acc[v] += val(x.v[v]);
  }
  Vec<S, V> y;
  PC_UNROLL
  for (int v = 0; v < V; ++v) y.v[v] = from_acc<S>(acc[v]);
  store_vec<V>(out + r * C + c, y);
}

// The one-source case as a copy of bits (S: an unsigned integer of the element's size): out[r, c .. c+V-1] =
// src(index[r])[c .. c+V-1], zero for -1.
template <typename S, int V = 1>
PC_HD void gather_copy_elem(S* out, const S* a, int64_t na, const S* b, const int64_t* index, int64_t C, int64_t r,
                            int64_t c) {
  const int64_t i = index[r];
  Vec<S, V> y;
  if (i >= 0) {
    y = load_vec<V>(source_at(a, na, b, i, C, c));
  } else {
    PC_UNROLL
    for (int v = 0; v < V; ++v) y.v[v] = S(0);
  }
  store_vec<V>(out + r * C + c, y);
}

}  // namespace packcuda::exchange
