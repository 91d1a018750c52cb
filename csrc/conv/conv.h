// packcuda core: varlen causal depthwise conv1d and the conv-prefix exchange, on raw pointers (no torch).
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

// ncclComm_t without including nccl.h (the same typedef nccl.h makes).
struct ncclComm;
typedef struct ncclComm* ncclComm_t;

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


// ------------------------------------------------------------------------------------------------------
// Conv-prefix exchange schedule (host, O(cp * pieces * K)). For one CP rank of a shard plan (see
// shard/shard.h), the K-1 padded rows that precede each local piece in its own segment — which rank holds
// each row and at which local slot (shard::locate) — and the mirror image: which of this rank's rows every
// other rank needs. Both sides derive the same lists from the same plan, so no handshake is needed. Rows
// before a segment's start (and every row of an empty piece) stay zero.
struct Schedule {
  int64_t cp = 1, rank = 0, K = 1, n_pieces = 0, n_local = 0;
  // Forward. send_index: local rows to send, grouped by peer in rank order (send_counts[p] rows for peer p).
  // The receive buffer holds recv_counts[p] rows from each peer, grouped in rank order. unpack[j] for prefix
  // slot j = piece * (K-1) + row: a local row r (value r), receive-buffer row i (value n_local + i), or -1.
  std::vector<int64_t> send_index, send_counts, recv_counts, unpack;
  // Backward (gradient rows travel the other way). bwd_send_index: prefix slots to send, grouped by peer
  // (recv_counts[p] rows each); the backward receive buffer has send_counts[p] rows per peer. The gradient
  // of local row r is sum_m src(bwd_unpack[r * bwd_m + m]) in this fixed order, where a value j <
  // n_pieces*(K-1) is prefix slot j and n_pieces*(K-1) + i is backward receive-buffer row i; -1 = nothing.
  std::vector<int64_t> bwd_send_index, bwd_unpack;
  int64_t bwd_m = 1;
  // Per peer: the first row when the rows sent to it are consecutive rows of the source (forward: of
  // send_index, backward: of bwd_send_index), else -1: the send_first of exchange_rows_nccl, which sends such
  // rows straight from the source, without a pack kernel.
  std::vector<int64_t> send_first, bwd_send_first;
};

// cu: original cu_seqlens [nseq + 1] (host); the plan parameters as in shard::build_layout (valid).
Schedule build_schedule(const int64_t* cu, int64_t nseq, int64_t cp, int64_t rank, int layout, int64_t align,
                        int64_t bucket, int K);

// ------------------------------------------------------------------------------------------------------
// Raw-NCCL exchange (compiled when nccl.h is found; PACKCUDA_WITH_NCCL is then defined for consumers).
// One grouped exchange on `stream`: pack kernel (src rows send_index -> send_buf); ncclGroupStart; ncclSend /
// ncclRecv per peer (send_counts[p] / recv_counts[p] rows, host arrays of cp entries; zero counts are
// skipped); ncclGroupEnd; unpack kernel out = gather_sum(a = src, b = recv_buf, unpack_index [n_out, M]).
// Forward: src = x_local, send_index / counts / unpack of a Schedule. Backward: src = prefix gradient
// [n_pieces*(K-1), C], bwd_send_index, the counts swapped, bwd_unpack. No host sync; capturable in a CUDA
// graph once the communicator's peer connections exist (run one exchange before capture).
bool nccl_available();
void nccl_unique_id(uint8_t* out128);                                     // ncclGetUniqueId
void* nccl_comm_init(const uint8_t* id128, int nranks, int rank);         // ncclCommInitRank on the current device
void exchange_rows_nccl(const void* src, int64_t n_src, const int64_t* send_index, const int64_t* send_counts,
                        const int64_t* recv_counts, void* send_buf, void* recv_buf, const int64_t* unpack_index,
                        int M, void* out, int64_t n_out, int64_t C, DType dtype, int64_t cp, int64_t rank,
                        ncclComm_t comm, cudaStream_t stream);
// The same with direct sends: when send_first (host, cp entries) is given and send_first[p] >= 0 for every peer
// p that is sent rows, peer p's rows are the consecutive src rows [send_first[p], send_first[p] +
// send_counts[p]) and go out straight from src: no pack kernel, and send_buf is not used (may be null).
// Otherwise (or with send_first = nullptr) every send is packed as above.
void exchange_rows_nccl(const void* src, int64_t n_src, const int64_t* send_index, const int64_t* send_counts,
                        const int64_t* recv_counts, const int64_t* send_first, void* send_buf, void* recv_buf,
                        const int64_t* unpack_index, int M, void* out, int64_t n_out, int64_t C, DType dtype,
                        int64_t cp, int64_t rank, ncclComm_t comm, cudaStream_t stream);
// True when exchange_rows_nccl with this send_first sends every row straight from src.
bool sends_direct(const int64_t* send_counts, const int64_t* send_first, int64_t cp, int64_t rank);

}  // namespace packcuda::conv
