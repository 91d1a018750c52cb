// packcuda core: the plan-driven row exchange between the ranks of a CP group, on raw pointers (no torch).
// CPU functions run on the calling thread; CUDA functions enqueue on `stream` and never synchronize.
//
// Vocabulary. Every rank holds a source buffer of rows (n_src rows of C elements) and fills an output buffer
// (n_out rows). A move (src_rank, src_row, dst_rank, dst_slot) says that row src_row of rank src_rank's source
// fills slot dst_slot of rank dst_rank's output. A schedule is one rank's view of a list of moves: which of its
// rows go to each peer, which of its slots each peer fills, and which slots its own rows fill (those rows are
// copied locally, never sent). Forward, a slot has at most one source (slots without one are zero rows); the
// reverse move (the gradient) sends every slot's row back to its source row and sums, in a fixed order, the
// slots that one source row fed. The users (conv prefix, layout bridge, ...) only say which rows go where.
#pragma once
#include <cstdint>
#include <vector>

#include "../common/dtype.h"
#include "../common/stream.h"

// ncclComm_t without including nccl.h (the same typedef nccl.h makes).
struct ncclComm;
typedef struct ncclComm* ncclComm_t;

namespace packcuda::exchange {

using packcuda::DType;  // common/dtype.h

struct Move {
  int64_t src_rank, src_row, dst_rank, dst_slot;
};

// Largest CP size a schedule is built for: every rank's schedule keeps lists for every peer (O(cp) memory).
constexpr int64_t kMaxCp = int64_t(1) << 16;

// One rank's schedule. Rows travel in the canonical order that both sides derive alike from the moves: by
// dst_rank, then dst_slot.
struct Schedule {
  int64_t cp = 1, rank = 0, n_src = 0, n_out = 0;
  // Forward. send_index: source rows to send, grouped by peer in rank order (send_counts[p] rows for peer p).
  // The receive buffer holds recv_counts[p] rows from each peer, grouped in rank order. unpack[j] for output
  // slot j: a source row r (value r), receive-buffer row i (value n_src + i), or -1 (a zero row).
  std::vector<int64_t> send_index, send_counts, recv_counts, unpack;
  // Reverse (gradient rows travel the other way). bwd_send_index: output slots to send back, grouped by peer
  // (recv_counts[p] rows each); the reverse receive buffer has send_counts[p] rows per peer. Source row r
  // gets sum_m g(bwd_unpack[r * bwd_m + m]) in this fixed order (the slots its own row fed, in slot order, then
  // the rows received back, in buffer order), where a value j < n_out is output slot j and n_out + i is
  // reverse receive-buffer row i; -1 = nothing.
  std::vector<int64_t> bwd_send_index, bwd_unpack;
  int64_t bwd_m = 1;
  // Per peer: the first row when the rows sent to it are consecutive rows of the source (forward: of
  // send_index, reverse: of bwd_send_index), else -1; such rows go out straight from the source (no pack).
  std::vector<int64_t> send_first, bwd_send_first;
};

// The schedule of rank `rank` of `cp` from the moves (any order; moves that involve neither this rank's source
// nor its output are ignored). Refused with std::invalid_argument("packcuda.<op>: ...") when a rank is outside
// [0, cp) (cp in [1, kMaxCp]), a row or slot is negative, a row of this rank's source is >= n_src, a slot of its output is
// >= n_out, or two moves fill the same slot. Host work O(moves log moves + cp + n_src + n_out).
Schedule build_schedule(const char* op, int64_t cp, int64_t rank, int64_t n_src, int64_t n_out,
                        std::vector<Move> moves);

// ------------------------------------------------------------------------------------------------------
// The unpack step: out[r] = sum_m src(index[r, m]) with src(i) = a[i] for i in [0, na), b[i - na] above,
// nothing for -1 (a row without source is zero). Rows of C elements of elem_size bytes.
//  M == 1: a copy of the row's bytes (any element type; elem_size 1, 2, 4 or 8).
//  M > 1:  a sum in the fixed order m = 0..M-1 accumulated in fp32 (fp64 for F64): dtype must be a float type.
struct GatherSum {
  void* out = nullptr;
  int64_t n_out = 0;
  const void* a = nullptr;
  int64_t na = 0;
  const void* b = nullptr;
  const int64_t* index = nullptr;  // [n_out, M], on the kernel's device
  int M = 1;
  int64_t C = 0;
  int elem_size = 4;
  DType dtype = DType::F32;  // of a, b and out when M > 1
};
void gather_sum_cpu(const GatherSum& g);
void gather_sum_cuda(const GatherSum& g, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------------
// Raw-NCCL move (compiled when nccl.h is found; PACKCUDA_WITH_NCCL is then defined for consumers). One
// direction of a schedule on `stream`: pack kernel (src rows send_index -> send_buf, skipped when every peer's
// rows are consecutive: they then go out straight from src); ncclGroupStart; ncclSend / ncclRecv per peer
// (zero counts skipped; this rank's own rows are never sent); ncclGroupEnd; unpack kernel
// out = gather_sum(a = src, b = recv_buf, unpack [n_out, M]). Forward: the Schedule's send_index / counts /
// send_first / unpack (M = 1). Reverse: src = the output gradient, bwd_send_index, the counts swapped,
// bwd_send_first, bwd_unpack (M = bwd_m). No host sync; capturable in a CUDA graph once the communicator's
// peer connections exist (run one move before capture).
struct ExchangeArgs {
  const void* src = nullptr;
  int64_t n_src = 0;
  const int64_t* send_index = nullptr;   // device, [sum(send_counts)]
  const int64_t* send_counts = nullptr;  // host, [cp]
  const int64_t* recv_counts = nullptr;  // host, [cp]
  const int64_t* send_first = nullptr;   // host, [cp] or null (every send is packed)
  const int64_t* unpack = nullptr;       // device, [n_out, M]
  int M = 1;
  void* out = nullptr;
  int64_t n_out = 0;
  void* send_buf = nullptr;  // [sum(send_counts), C]; unused when sends_direct
  void* recv_buf = nullptr;  // [sum(recv_counts), C]
  int64_t C = 0;
  int elem_size = 4;
  DType dtype = DType::F32;  // when M > 1
  int64_t cp = 1, rank = 0;
};
bool nccl_available();
void nccl_unique_id(uint8_t* out128);                              // ncclGetUniqueId
void* nccl_comm_init(const uint8_t* id128, int nranks, int rank);  // ncclCommInitRank on the current device
void exchange_rows_nccl(const ExchangeArgs& a, ncclComm_t comm, cudaStream_t stream);
// True when every peer p != rank that is sent rows has send_first[p] >= 0 (the sends need no pack kernel).
bool sends_direct(const int64_t* send_counts, const int64_t* send_first, int64_t cp, int64_t rank);

}  // namespace packcuda::exchange
