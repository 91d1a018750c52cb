// Raw-NCCL row move: pack, one NCCL group of sends/receives, unpack — all on one stream.
#include <nccl.h>

#include <cstring>

#include "common/cuda_utils.cuh"
#include "exchange/exchange.h"
#include "pack/pack.h"

#define PC_NCCL_CHECK(expr)                                                                                           \
  do {                                                                                                                \
    ncclResult_t _r = (expr);                                                                                         \
    if (_r != ncclSuccess)                                                                                            \
      throw std::runtime_error(                                                                                       \
          ::packcuda::detail::cat("packcuda NCCL error: ", ncclGetErrorString(_r), " at ", __FILE__, ":", __LINE__)); \
  } while (0)

namespace packcuda::exchange {

bool nccl_available() { return true; }

void nccl_unique_id(uint8_t* out128) {
  static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId size");
  ncclUniqueId id;
  PC_NCCL_CHECK(ncclGetUniqueId(&id));
  memcpy(out128, &id, sizeof(id));
}

void* nccl_comm_init(const uint8_t* id128, int nranks, int rank) {
  ncclUniqueId id;
  memcpy(&id, id128, sizeof(id));
  ncclComm_t comm = nullptr;
  PC_NCCL_CHECK(ncclCommInitRank(&comm, nranks, id, rank));
  return comm;
}

bool sends_direct(const int64_t* send_counts, const int64_t* send_first, int64_t cp, int64_t rank) {
  if (send_first == nullptr) return false;
  for (int64_t p = 0; p < cp; ++p)
    if (p != rank && send_counts[p] > 0 && send_first[p] < 0) return false;
  return true;
}

void exchange_rows_nccl(const ExchangeArgs& a, ncclComm_t comm, cudaStream_t stream) {
  const int64_t row_bytes = a.C * a.elem_size;
  const bool direct = sends_direct(a.send_counts, a.send_first, a.cp, a.rank);
  int64_t n_send = 0;
  for (int64_t p = 0; p < a.cp; ++p) n_send += a.send_counts[p];
  if (!direct && n_send > 0 && row_bytes > 0)
    pack::gather_rows_cuda(a.send_buf, a.src, a.send_index, n_send, row_bytes, 0, a.elem_size, stream);
  PC_NCCL_CHECK(ncclGroupStart());
  int64_t so = 0, ro = 0;
  for (int64_t p = 0; p < a.cp; ++p) {
    if (p == a.rank) continue;
    const size_t sb = static_cast<size_t>(a.send_counts[p] * row_bytes);
    const size_t rb = static_cast<size_t>(a.recv_counts[p] * row_bytes);
    const char* from = direct ? static_cast<const char*>(a.src) + a.send_first[p] * row_bytes
                              : static_cast<const char*>(a.send_buf) + so;
    if (sb) PC_NCCL_CHECK(ncclSend(from, sb, ncclChar, static_cast<int>(p), comm, stream));
    if (rb)
      PC_NCCL_CHECK(ncclRecv(static_cast<char*>(a.recv_buf) + ro, rb, ncclChar, static_cast<int>(p), comm, stream));
    so += sb;
    ro += rb;
  }
  PC_NCCL_CHECK(ncclGroupEnd());
  GatherSum g;
  g.out = a.out;
  g.n_out = a.n_out;
  g.a = a.src;
  g.na = a.n_src;
  g.b = a.recv_buf;
  g.index = a.unpack;
  g.M = a.M;
  g.C = a.C;
  g.elem_size = a.elem_size;
  g.dtype = a.dtype;
  gather_sum_cuda(g, stream);
}

}  // namespace packcuda::exchange
