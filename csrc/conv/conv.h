// packcuda core: varlen causal depthwise conv1d and the conv-prefix exchange, on raw pointers (no torch).
// CPU functions run on the calling thread; CUDA functions enqueue on `stream` and never synchronize.
//
// Layouts: x, y, dy, dx [T, C] row-major; weight, dweight [C, K]; bias, dbias [C]; prefix, dprefix
// [S, K-1, C] (S = number of segments of cu, the K-1 rows that precede segment s); cu int64 [S + 1]
// (cu[0] = 0, non-decreasing, cu[S] = T). Every segment is convolved on its own: the taps before its first
// token read prefix[s] (or zeros when prefix is null). See conv_math.h for the formulas.
#pragma once
#include <cstdint>

#include "common/stream.h"

namespace packcuda::conv {

constexpr int kMaxK = 8;  // largest supported kernel size

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2, F64 = 3 };
inline int dtype_size(DType t) { return t == DType::F64 ? 8 : t == DType::F32 ? 4 : 2; }

struct ConvArgs {
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;    // optional
  const void* prefix = nullptr;  // optional
  const int64_t* cu = nullptr;   // on the kernel's device
  int64_t T = 0, C = 0, nseg = 0;
  int K = 0;                     // 1..8
  int activation = 0;            // 0 identity, 1 silu
  DType dtype = DType::F32;      // of x, weight, bias, prefix and every output
};

// y = act(conv(x)).
void causal_conv1d_fwd_cpu(const ConvArgs& a, void* y);
void causal_conv1d_fwd_cuda(const ConvArgs& a, void* y, cudaStream_t stream);

// Backward. dx is always written; dprefix (optional, needs prefix) is written completely (zeros for empty
// segments); dweight / dbias (dbias optional) come from per-tile fp32 partial sums reduced in a fixed order:
// deterministic, no atomics. `work` holds conv_bwd_work_elems(...) accumulators (fp32, fp64 for F64).
int64_t conv_bwd_tiles_cpu(int64_t T);
int64_t conv_bwd_tiles_cuda(int64_t T, int64_t C);
inline int64_t conv_bwd_work_elems(int64_t tiles, int64_t C, int K) { return tiles * C * (K + 1); }
void causal_conv1d_bwd_cpu(const ConvArgs& a, const void* dy, void* dx, void* dweight, void* dbias,
                           void* dprefix, void* work, int64_t tiles);
void causal_conv1d_bwd_cuda(const ConvArgs& a, const void* dy, void* dx, void* dweight, void* dbias,
                            void* dprefix, void* work, int64_t tiles, cudaStream_t stream);

// Two-source row gather-sum (the unpack step of the exchange): out[r] = sum_m src(index[r, m]) with index in
// [0, na) -> a, [na, na + nb) -> b, -1 -> nothing; fixed order, fp32 accumulation. Rows of C elements.
void gather_sum_cpu(void* out, int64_t n_out, const void* a, int64_t na, const void* b, const int64_t* index,
                    int M, int64_t C, DType dtype);
void gather_sum_cuda(void* out, int64_t n_out, const void* a, int64_t na, const void* b, const int64_t* index,
                     int M, int64_t C, DType dtype, cudaStream_t stream);

}  // namespace packcuda::conv
