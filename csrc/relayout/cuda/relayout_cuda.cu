// CUDA pass of the layout bridge's static tables (one launch over the three tables).
#include "exchange/exchange_static.cuh"
#include "relayout/relayout.h"

namespace packcuda::relayout {

void static_tables_cuda(const StaticRelayout& r, const exchange::StaticTables& t, cudaStream_t stream) {
  exchange::static_tables_cuda(t, r, stream);
}

}  // namespace packcuda::relayout
