// packcuda core: varlen causal depthwise conv1d and the moves of the conv-prefix exchange, on raw pointers (no
// torch).
// CPU functions run on the calling thread; CUDA functions enqueue on `stream` and never synchronize.
//
// Layouts: x, y, dy, dx [T, C] row-major; weight, dweight [C, K]; bias, dbias [C]; prefix, dprefix
// [S, K-1, C] (S = number of segments of cu, the K-1 rows that precede segment s); cu int64 [S + 1]
// (cu[0] = 0, non-decreasing, cu[S] = T). Every segment is convolved on its own: the taps before its first
// token read prefix[s] (or zeros when prefix is null). See conv_math.h for the formulas.
#pragma once
#include <cstdint>
#include <vector>

#include "../common/dtype.h"
#include "../common/stream.h"
#include "../exchange/exchange.h"
#include "../exchange/exchange_static.h"
#include "conv_static_math.h"

namespace packcuda::conv {

constexpr int kMaxK = 8;  // largest supported kernel size
// Most cu entries a CUDA launch takes in its kernel parameters: host cu_seqlens of up to kInlineCu - 1
// segments reach the kernels without an upload (no copy on the stream). 480 entries keep every conv kernel's
// parameters within 4 KB.
constexpr int64_t kInlineCu = 480;

using packcuda::DType;  // common/dtype.h
using packcuda::dtype_size;

struct ConvArgs {
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;    // optional
  const void* prefix = nullptr;  // optional
  const int64_t* cu = nullptr;       // on the kernel's device; for CUDA null when cu_host is given instead
  const int64_t* cu_host = nullptr;  // the values on the host (CUDA, at most kInlineCu entries; else null)
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
int64_t conv_bwd_tiles_cuda(const ConvArgs& a);  // depends on T, C, K, dtype and the device
inline int64_t conv_bwd_work_elems(int64_t tiles, int64_t C, int K) { return tiles * C * (K + 1); }
void causal_conv1d_bwd_cpu(const ConvArgs& a, const void* dy, void* dx, void* dweight, void* dbias, void* dprefix,
                           void* work, int64_t tiles);
void causal_conv1d_bwd_cuda(const ConvArgs& a, const void* dy, void* dx, void* dweight, void* dbias, void* dprefix,
                            void* work, int64_t tiles, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------------
// Conv-prefix moves (host, O(cp * pieces * K)): which rows go where for the conv prefix of one CP rank of a
// shard plan (see shard/shard.h), in the words of the row exchange (exchange/exchange.h). Output slot
// piece * (K-1) + j is prefix row j of local piece `piece`: the padded row K-1-j rows before the piece's start in
// its own segment, held by the rank and local slot shard::locate names. The moves returned are those that
// involve this rank: the rows its own pieces read, and the rows of its buffer that other ranks' pieces read
// (every rank derives the same moves from the same plan, so no handshake is needed). Rows before a segment's
// start, and every row of an empty piece, have no move (zero rows).
struct PrefixMoves {
  std::vector<exchange::Move> moves;
  int64_t n_pieces = 0;  // pieces of this rank (output slots: n_pieces * (K-1))
  int64_t n_local = 0;   // rows of this rank's buffer (the exchange's source)
};
// cu: original cu_seqlens [nseq + 1] (host); the plan parameters as in shard::build_layout (valid).
PrefixMoves prefix_moves(const int64_t* cu, int64_t nseq, int64_t cp, int64_t rank, int layout, int64_t align,
                         int64_t bucket, int K);

// The conv-prefix tables of a static plan (StaticPrefix in conv_static_math.h) into t (n_send = cp * SQ,
// n_unpack = SQ, n_bwd = total_local * k1). One pass (one launch on CUDA).
void static_prefix_tables_cpu(const StaticPrefix& p, const exchange::StaticTables& t);
void static_prefix_tables_cuda(const StaticPrefix& p, const exchange::StaticTables& t, cudaStream_t stream);

}  // namespace packcuda::conv
