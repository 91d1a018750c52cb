// Rotary-embedding math shared by the CPU and CUDA kernels of apply_rope: the slot -> position-axis map
// (plain / sectioned / interleaved mRoPE), the channel pairing (neox / gptj), the angle, cos/sin and the
// rotation of one pair. The angle is always fp32; cos/sin and the rotation are fp32 (fp64 for fp64 data);
// callers round once to the output dtype.
#pragma once
#include <cmath>
#include <cstdint>

#include "../common/dtype.h"
#include "../common/hd.h"

namespace packcuda::rope {

// Axis layouts of the frequency slots (values match RopeArgs::layout).
enum : int { kPlain = 0, kSectioned = 1, kInterleaved = 2 };

// Position row (0 = t, 1 = h, 2 = w) that drives frequency slot j.
//  plain:       always row 0 (one row of positions).
//  sectioned:   j < s0 -> t, j < s0 + s1 -> h, else w                  (Qwen2/2.5-VL, [16, 24, 24]).
//  interleaved: h if j % 3 == 1 and j < 3 * s1, w if j % 3 == 2 and j < 3 * s2, else t
//               (Qwen3-VL [24, 20, 20], Qwen3.5 [11, 11, 10]).
PC_HD int slot_axis(int64_t j, int layout, int64_t s0, int64_t s1, int64_t s2) {
  if (layout == kSectioned) return j < s0 ? 0 : (j < s0 + s1 ? 1 : 2);
  if (layout == kInterleaved) {
    const int64_t r = j % 3;
    if (r == 1 && j < 3 * s1) return 1;
    if (r == 2 && j < 3 * s2) return 2;
    return 0;
  }
  return 0;
}

// Channels of the pair rotated by slot j (n = rotary_dim / 2).
//  neox (rotate_half): (j, j + n);   gptj: (2j, 2j + 1).
PC_HD int64_t pair_lo(int64_t j, bool gptj) { return gptj ? 2 * j : j; }
PC_HD int64_t pair_hi(int64_t j, int64_t n, bool gptj) { return gptj ? 2 * j + 1 : j + n; }

// angle = float32(pos) * inv_freq[j], one fp32 multiply (never a reduced-precision matmul).
PC_HD float rope_angle(int64_t pos, float inv_freq) { return static_cast<float>(pos) * inv_freq; }

// cos/sin of the angle with accurate library functions (no fast intrinsics), times attention_scaling.
// F is the compute type: float for bf16/fp16/fp32 data, double for fp64 data (the angle itself is always the
// fp32 product above). inverse = rotation by the negated angle (the backward pass: R(-a) = R(a)^T).
template <typename F>
PC_HD void rope_cos_sin(float angle, F scaling, bool inverse, F* c, F* s) {
  F sn, cs;
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(F) == 4) sincosf(angle, &sn, &cs);
  else sincos(static_cast<double>(angle), &sn, &cs);
#else
  sn = std::sin(static_cast<F>(angle));
  cs = std::cos(static_cast<F>(angle));
#endif
  *c = cs * scaling;
  *s = inverse ? -(sn * scaling) : sn * scaling;
}

// Rotation of one pair in the compute type: (lo, hi) -> (lo*c - hi*s, hi*c + lo*s).
// On the GPU each output is one fused multiply-add over the other product rounded first, written out so that
// every kernel instantiation (vector width, in place or not) rounds the same way; left to itself the compiler
// may contract either product.
template <typename F>
PC_HD void rotate_pair(F lo, F hi, F c, F s, F* out_lo, F* out_hi) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(F) == 4) {
    *out_lo = fmaf(lo, c, -__fmul_rn(hi, s));
    *out_hi = fmaf(hi, c, __fmul_rn(lo, s));
  } else {
    *out_lo = fma(lo, c, -__dmul_rn(hi, s));
    *out_hi = fma(hi, c, __dmul_rn(lo, s));
  }
#else
  *out_lo = lo * c - hi * s;
  *out_hi = hi * c + lo * s;
#endif
}

// Token t of a [B, S, H, D] / [T, H, D] view is (b, s) = (t / seq, t % seq); its offset (in elements) is
// b * stride_b + s * stride_s.
struct TokenIndex {
  int64_t b, s;
  PC_HD TokenIndex(int64_t t, int64_t seq) : b(t < seq ? 0 : t / seq), s(t - b * seq) {}
  PC_HD int64_t offset(int64_t stride_b, int64_t stride_s) const { return b * stride_b + s * stride_s; }
};
PC_HD int64_t token_offset(int64_t t, int64_t seq, int64_t stride_b, int64_t stride_s) {
  return TokenIndex(t, seq).offset(stride_b, stride_s);
}

// ---------------------------------------------------------------------------------------------------
// Per-head QK norm fused with the rotation (apply_qk_norm_rope). A head row x of D channels is normalized over
// all D channels, rstd = 1 / sqrt(sum(x^2) / D + eps) (fp32; fp64 for fp64 data), then the rotary channels are
// rotated and the pass-through channels are written normalized.
//  kNormRms       (Qwen3, Qwen3-VL):  n = w * round(x * rstd)   (round: to the data dtype, as transformers'
//                                                                 `.to(input_dtype)` before the weight)
//  kNormRmsOffset (Qwen3.5):           n = x * rstd * (1 + w)
// n is kept in the compute type (not rounded) and rotated; the output is rounded once.
// ---------------------------------------------------------------------------------------------------
enum : int { kNormRms = 0, kNormRmsOffset = 1 };

// rstd of a row from its variance (sum(x^2) / D): 1 / sqrt(var + eps).
template <typename F>
PC_HD F norm_rstd_of_var(F var, F eps) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(F) == 4) return 1.0f / sqrtf(var + eps);  // IEEE sqrt and division (no rsqrtf)
  else return 1.0 / sqrt(var + eps);
#else
  return F(1) / std::sqrt(var + eps);
#endif
}

template <typename F>
PC_HD F norm_rstd(F sumsq, int64_t D, F eps) {
  return norm_rstd_of_var(sumsq / static_cast<F>(D), eps);
}

// xhat as the weight sees it: x * rstd, rounded to the data dtype for kNormRms (round: F -> F through the
// data dtype; the identity for fp32/fp64 data).
template <typename F, typename Round>
PC_HD F norm_xhat(F x, F rstd, int norm, Round round) {
  const F xh = x * rstd;
  return norm == kNormRms ? round(xh) : xh;
}

// Effective per-channel factor: w (kNormRms) or 1 + w (kNormRmsOffset).
template <typename F>
PC_HD F norm_gain(F w, int norm) {
  return norm == kNormRms ? w : F(1) + w;
}

// Backward of one row, per channel, given gn = the gradient w.r.t. the normalized value n (the incoming
// gradient rotated back), x, rstd and the gain:
//   dxh = gn * gain,  dot = sum(dxh * x * rstd) over the row,  dx = rstd * (dxh - x * rstd * dot / D)
//   dw  = sum over rows of gn * norm_xhat(x)      (the .to(dtype) of kNormRms passes gradients unchanged)
// dot_d = dot / D (a kernel divides once per row).
template <typename F>
PC_HD F norm_dx_of(F dxh, F x, F rstd, F dot_d) {
  return rstd * (dxh - x * rstd * dot_d);
}
template <typename F>
PC_HD F norm_dx(F dxh, F x, F rstd, F dot, int64_t D) {
  return norm_dx_of(dxh, x, rstd, dot / static_cast<F>(D));
}

// The QK norm's weights: element c of a [D] weight of dtype W (stride in elements) in the compute type F (an
// exact widening), and a weight gradient accumulated in F rounded once to W (the value .to(W) of the F gradient
// gives; F itself when W is F).
template <typename W, typename F>
PC_HD F weight_in(const void* w, int64_t c, int64_t stride) {
  return static_cast<F>(Elem<W>::load(static_cast<const W*>(w)[c * stride]));
}
template <typename W, typename F>
PC_HD void weight_grad_out(void* dw, int64_t c, F v) {
  static_cast<W*>(dw)[c] = From<W>::cvt(v);
}

}  // namespace packcuda::rope
