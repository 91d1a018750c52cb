// Without NCCL (CPU-only builds, or nccl.h not found) the raw-NCCL entry points report that they are missing.
// CMake compiles this file instead of exchange_nccl.cu in such builds.
#include <stdexcept>

#include "exchange/exchange.h"

namespace packcuda::exchange {

bool nccl_available() { return false; }
static void no_nccl() { throw std::runtime_error("packcuda was built without NCCL (nccl.h not found)"); }
void nccl_unique_id(uint8_t*) { no_nccl(); }
void* nccl_comm_init(const uint8_t*, int, int) {
  no_nccl();
  return nullptr;
}
void exchange_rows_nccl(const ExchangeArgs&, ncclComm_t, cudaStream_t) { no_nccl(); }
bool sends_direct(const int64_t*, const int64_t*, int64_t, int64_t) { return false; }

}  // namespace packcuda::exchange
