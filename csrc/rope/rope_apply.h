// packcuda core: fused rotary application (1D RoPE and mRoPE, sectioned / interleaved / partial) on raw
// pointers, no torch. One call rotates q and k together; the CUDA version enqueues on `stream`, never
// synchronizes and allocates nothing (CUDA-graph capturable).
#pragma once
#include <cstdint>

#include "../common/dtype.h"
#include "../common/stream.h"

namespace packcuda::rope {

using packcuda::DType;  // common/dtype.h

// A [B, S, H, D] (or [T, H, D] with seq = T, stride_b = 0) view; strides in elements, last dim contiguous.
struct HeadsView {
  const void* in = nullptr;
  void* out = nullptr;  // == in for the in-place version
  int64_t in_sb = 0, in_ss = 0, in_sh = 0;
  int64_t out_sb = 0, out_ss = 0, out_sh = 0;
  int64_t heads = 0;
};

struct RopeArgs {
  DType dtype = DType::F32;
  int64_t tokens = 0;        // B * S
  int64_t seq = 1;           // S: token t is (t / seq, t % seq)
  int64_t head_dim = 0;      // D
  int64_t rotary_dim = 0;    // even, <= D; channels >= rotary_dim pass through
  HeadsView q, k;
  // positions: rows x tokens, element (r, t = b * seq + s) at pos[r * pos_row_stride + b * pos_sb + s * pos_ss];
  // int32 or int64. Plain RoPE has one row (only row 0 is read).
  const void* pos = nullptr;
  bool pos_int64 = true;
  int64_t pos_row_stride = 0, pos_sb = 0, pos_ss = 1;
  const float* inv_freq = nullptr;  // [rotary_dim / 2], fp32, contiguous
  int layout = 0;                   // kPlain / kSectioned / kInterleaved (rope_math.h)
  int64_t section[3] = {0, 0, 0};
  bool gptj = false;
  double scaling = 1.0;  // attention_scaling (rounded to fp32 for fp32 compute)
  bool inverse = false;          // rotate by -angle (backward)
  bool copy_passthrough = true;  // out-of-place: copy channels >= rotary_dim; in place: leave them alone
};

// Largest rotary_dim the kernels accept (the CUDA kernel keeps one token's cos/sin in shared memory).
constexpr int64_t kMaxRotaryDim = 8192;

void rope_apply_cpu(const RopeArgs& a);
void rope_apply_cuda(const RopeArgs& a, cudaStream_t stream);

// Per-head QK norm fused with the rotation (rope_math.h: kNormRms / kNormRmsOffset). Forward: r.q / r.k map the
// inputs x to the outputs y (in == out in place; copy_passthrough is ignored: the pass-through channels are
// always written, normalized). Backward: r.q / r.k map the saved inputs x to the gradients dx (out), g_q / g_k
// hold the incoming gradients (in only, same heads as x), and dw_q / dw_k receive the [D] weight gradients,
// accumulated in the compute type (fp32; fp64 for fp64 data) and written in dw_dtype (the weights' dtype),
// reduced in a fixed order (no atomics): the result is bitwise reproducible for a given device and shape.
struct NormArgs {
  RopeArgs r;
  const void* w_q = nullptr;  // [D], contiguous, in the compute type (fp32; fp64 for fp64 data)
  const void* w_k = nullptr;
  double eps = 1e-6;
  int norm = 0;
  DType dw_dtype = DType::F32;  // backward: the weights' dtype (in the padding after norm: the layout is kept)
  HeadsView g_q, g_k;           // backward only (in, in_s*)
  void* dw_q = nullptr;         // backward only: [D] in dw_dtype
  void* dw_k = nullptr;
  void* workspace = nullptr;    // CUDA backward: qk_norm_workspace_floats(D) elements of the compute type
};

// Largest head_dim of the fused norm + rotation (one row is held in registers by the CUDA kernel).
constexpr int64_t kMaxNormHeadDim = 512;
// Most blocks of the CUDA backward (each writes one [2, D] partial of the weight gradients); the grid is fixed
// by the shape, so the reduction order does not depend on the device.
constexpr int64_t kNormBwdBlocks = 1024;
inline int64_t qk_norm_workspace_floats(int64_t D) { return kNormBwdBlocks * 2 * D; }

// The two [D] weights of the norm in the compute type, in one pass (one launch on CUDA): out[c] = w_q[c * stride_q]
// and out[ld + c] = w_k[c * stride_k], c < D; exact (bf16 / fp16 / fp32 -> fp32, fp32 / fp64 -> fp64).
struct WeightsCast {
  const void* w_q = nullptr;
  const void* w_k = nullptr;
  int64_t stride_q = 1, stride_k = 1;
  DType w = DType::F32;  // the weights' dtype
  void* out = nullptr;   // [2, ld] in acc
  DType acc = DType::F32;
  int64_t D = 0, ld = 0;
};

void cast_weights_cpu(const WeightsCast& a);
void cast_weights_cuda(const WeightsCast& a, cudaStream_t stream);

void qk_norm_rope_cpu(const NormArgs& a);
void qk_norm_rope_backward_cpu(const NormArgs& a);
void qk_norm_rope_cuda(const NormArgs& a, cudaStream_t stream);
void qk_norm_rope_backward_cuda(const NormArgs& a, cudaStream_t stream);

}  // namespace packcuda::rope
