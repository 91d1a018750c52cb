// CUDA pass of the conv-prefix tables of a static plan (one launch over the three tables).
#include "conv/conv.h"
#include "exchange/exchange_static.cuh"

namespace packcuda::conv {

void static_prefix_tables_cuda(const StaticPrefix& p, const exchange::StaticTables& t, cudaStream_t stream) {
  exchange::static_tables_cuda(t, p, stream);
}

}  // namespace packcuda::conv
