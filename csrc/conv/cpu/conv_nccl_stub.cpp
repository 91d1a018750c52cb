// Without NCCL (CPU-only builds, or nccl.h not found) the raw-NCCL entry points report that they are missing.
#ifndef PACKCUDA_WITH_NCCL
#include <stdexcept>

#include "conv/conv.h"

namespace packcuda::conv {

bool nccl_available() { return false; }
static void no_nccl() { throw std::runtime_error("packcuda was built without NCCL (nccl.h not found)"); }
void nccl_unique_id(uint8_t*) { no_nccl(); }
void* nccl_comm_init(const uint8_t*, int, int) {
  no_nccl();
  return nullptr;
}
void exchange_rows_nccl(const void*, int64_t, const int64_t*, const int64_t*, const int64_t*, void*, void*,
                        const int64_t*, int, void*, int64_t, int64_t, DType, int64_t, int64_t, ncclComm_t,
                        cudaStream_t) {
  no_nccl();
}
void exchange_rows_nccl(const void*, int64_t, const int64_t*, const int64_t*, const int64_t*, const int64_t*, void*,
                        void*, const int64_t*, int, void*, int64_t, int64_t, DType, int64_t, int64_t, ncclComm_t,
                        cudaStream_t) {
  no_nccl();
}
bool sends_direct(const int64_t*, const int64_t*, int64_t, int64_t) { return false; }

}  // namespace packcuda::conv
#endif
