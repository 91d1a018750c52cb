// What the rotary kernels (rope_apply_cuda.cu) and the two QK-norm families (qk_norm_tile_cuda.cu, the tile
// kernel; qk_norm_wtok_cuda.cu, one warp per token) share: the (cos, sin) entries of their shared-memory tables
// and how a tile's table is filled, the stride check of the vector paths, and the two functions one family's
// file calls in another's.
#pragma once
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "common/dtype.h"
#include "common/vec.h"
#include "rope/rope_apply.h"
#include "rope/rope_math.h"

namespace packcuda::rope::detail {

// (cos, sin) of one (token, slot).
template <typename F>
struct alignas(2 * sizeof(F)) CosSin {
  F c, s;
};

// Two consecutive (cos, sin) entries of one unit: one 16-byte shared load (two for fp64).
template <typename F>
struct alignas(16) CosSin2 {
  CosSin<F> a, b;
};

// cos/sin of every (token, slot) of a tile into the shared table cs [ntok][n] (n = rotary_dim / 2): entry e of
// local token tl holds slot slot_of(e) (each kernel's layout, read conflict-free by its lanes; consecutive
// threads store consecutive entries); pos_base(tl) is the token's offset into the positions.
template <typename F, typename PosBase, typename SlotOf>
__device__ __forceinline__ void fill_cos_sin(CosSin<F>* cs, const RopeArgs& a, int ntok, int n, bool inverse,
                                             PosBase pos_base, SlotOf slot_of) {
  for (int i = threadIdx.x; i < ntok * n; i += blockDim.x) {
    const int tl = i / n, j = slot_of(i - tl * n);
    const int r = slot_axis(j, a.layout, a.section[0], a.section[1], a.section[2]);
    const int64_t off = r * a.pos_row_stride + pos_base(tl);
    const int64_t pos =
        a.pos_int64 ? __ldg(static_cast<const long long*>(a.pos) + off) : __ldg(static_cast<const int*>(a.pos) + off);
    CosSin<F> w;
    rope_cos_sin(rope_angle(pos, __ldg(a.inv_freq + j)), static_cast<F>(a.scaling), inverse, &w.c, &w.s);
    cs[i] = w;
  }
}

// A view's strides are multiples of ve elements (a vector of ve elements never straddles a row).
inline bool strides_ok(const HeadsView& v, int64_t ve) {
  return v.in_sb % ve == 0 && v.in_ss % ve == 0 && v.in_sh % ve == 0 && v.out_sb % ve == 0 && v.out_ss % ve == 0 &&
         v.out_sh % ve == 0;
}

// The QK-norm backward's weight gradients: dw_q / dw_k [D] = the blocks' [2, D] partials in part summed in block
// order, written in the weights' dtype w (qk_norm_tile_cuda.cu; F float or double).
template <typename F>
void sum_partials(const F* part, int nblocks, int D, void* dw_q, void* dw_k, DType w, cudaStream_t stream);

// The warp-per-token QK-norm kernels (qk_norm_wtok_cuda.cu) where they apply: T bf16_t or f16_t on the 16-byte
// vector path with neox pairs (the caller checks those), head_dim 64, 128 or 256 and rotary_dim a multiple of
// 16. Returns whether they ran.
template <typename T, int NK>
bool qk_norm_wtok(const NormArgs& a, bool bwd, cudaStream_t stream);

}  // namespace packcuda::rope::detail
