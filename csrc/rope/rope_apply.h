// packcuda core: fused rotary application (1D RoPE and mRoPE, sectioned / interleaved / partial) on raw
// pointers, no torch. One call rotates q and k together; the CUDA version enqueues on `stream`, never
// synchronizes and allocates nothing (CUDA-graph capturable).
#pragma once
#include <cstdint>

#include "common/stream.h"

namespace packcuda::rope {

enum class Dtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// A [B, S, H, D] (or [T, H, D] with seq = T, stride_b = 0) view; strides in elements, last dim contiguous.
struct HeadsView {
  const void* in = nullptr;
  void* out = nullptr;  // == in for the in-place version
  int64_t in_sb = 0, in_ss = 0, in_sh = 0;
  int64_t out_sb = 0, out_ss = 0, out_sh = 0;
  int64_t heads = 0;
};

struct RopeArgs {
  Dtype dtype = Dtype::kFloat32;
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

}  // namespace packcuda::rope
