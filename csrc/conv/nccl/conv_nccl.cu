// Raw-NCCL conv-prefix exchange: pack, one NCCL group of sends/receives, unpack — all on one stream.
#include <nccl.h>

#include "common/cuda_utils.cuh"
#include "conv/conv.h"
#include "pack/pack.h"

#define PC_NCCL_CHECK(expr)                                                                            \
  do {                                                                                                 \
    ncclResult_t _r = (expr);                                                                          \
    if (_r != ncclSuccess)                                                                             \
      throw std::runtime_error(::packcuda::detail::cat("packcuda NCCL error: ", ncclGetErrorString(_r), \
                                                       " at ", __FILE__, ":", __LINE__));              \
  } while (0)

namespace packcuda::conv {

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

void exchange_rows_nccl(const void* src, int64_t n_src, const int64_t* send_index, const int64_t* send_counts,
                        const int64_t* recv_counts, const int64_t* send_first, void* send_buf, void* recv_buf,
                        const int64_t* unpack_index, int M, void* out, int64_t n_out, int64_t C, DType dtype,
                        int64_t cp, int64_t rank, ncclComm_t comm, cudaStream_t stream) {
  const int esz = dtype_size(dtype);
  const int64_t row_bytes = C * esz;
  const bool direct = sends_direct(send_counts, send_first, cp, rank);
  int64_t n_send = 0;
  for (int64_t p = 0; p < cp; ++p) n_send += send_counts[p];
  if (!direct && n_send > 0 && row_bytes > 0)
    pack::gather_rows_cuda(send_buf, src, send_index, n_send, row_bytes, 0, esz, stream);
  PC_NCCL_CHECK(ncclGroupStart());
  int64_t so = 0, ro = 0;
  for (int64_t p = 0; p < cp; ++p) {
    if (p == rank) continue;
    const size_t sb = static_cast<size_t>(send_counts[p] * row_bytes);
    const size_t rb = static_cast<size_t>(recv_counts[p] * row_bytes);
    const char* from = direct ? static_cast<const char*>(src) + send_first[p] * row_bytes
                              : static_cast<const char*>(send_buf) + so;
    if (sb) PC_NCCL_CHECK(ncclSend(from, sb, ncclChar, static_cast<int>(p), comm, stream));
    if (rb) PC_NCCL_CHECK(ncclRecv(static_cast<char*>(recv_buf) + ro, rb, ncclChar, static_cast<int>(p), comm,
                                   stream));
    so += sb;
    ro += rb;
  }
  PC_NCCL_CHECK(ncclGroupEnd());
  gather_sum_cuda(out, n_out, src, n_src, recv_buf, unpack_index, M, C, dtype, stream);
}

void exchange_rows_nccl(const void* src, int64_t n_src, const int64_t* send_index, const int64_t* send_counts,
                        const int64_t* recv_counts, void* send_buf, void* recv_buf, const int64_t* unpack_index,
                        int M, void* out, int64_t n_out, int64_t C, DType dtype, int64_t cp, int64_t rank,
                        ncclComm_t comm, cudaStream_t stream) {
  exchange_rows_nccl(src, n_src, send_index, send_counts, recv_counts, nullptr, send_buf, recv_buf, unpack_index, M,
                     out, n_out, C, dtype, cp, rank, comm, stream);
}

}  // namespace packcuda::conv
