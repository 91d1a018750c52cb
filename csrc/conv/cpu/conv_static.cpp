// CPU pass of the conv-prefix tables of a static plan.
#include "conv/conv.h"

namespace packcuda::conv {

void static_prefix_tables_cpu(const StaticPrefix& p, const exchange::StaticTables& t) {
  exchange::static_tables_cpu(t, p);
}

}  // namespace packcuda::conv
