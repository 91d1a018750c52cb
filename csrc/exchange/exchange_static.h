// The fixed-size (static) move of the row exchange: every rank sends every peer the same number of rows B (a
// bound fixed by the shapes, zero rows where it has none), in one equal-split all-to-all, so that nothing
// depends on values read back to the host (capturable in a CUDA graph). Its three tables, built on the device by
// the user of the move (which rows go where) in one pass over their concatenation:
//   send   [cp * B]      source row that goes to peer p at position i of p's block (p*B + i), -1: a zero row;
//   unpack [n_out]       row of the received buffer [cp * B] (peer-major) that each output slot takes, -1: none
//                        (each received row feeds at most one slot);
//   bwd    [n_src, M]    rows of the gradient buffer sent back [cp * B] (in the layout of send) that each source
//                        row sums, in this fixed order, -1: none.
// CPU here; the CUDA launch is in exchange_static.cuh.
#pragma once
#include <cstdint>

#include "../common/hd.h"

namespace packcuda::exchange {

struct StaticTables {
  int64_t* send = nullptr;
  int64_t n_send = 0;
  int64_t* unpack = nullptr;
  int64_t n_unpack = 0;
  int64_t* bwd = nullptr;
  int64_t n_bwd = 0;  // n_src * M entries
  PC_HD int64_t total() const { return n_send + n_unpack + n_bwd; }
};

// Entry i of the concatenation send | unpack | bwd, from item(table, j) (table 0, 1, 2; j within the table).
template <typename Item>
PC_HD void static_tables_write(const StaticTables& t, const Item& item, int64_t i) {
  if (i < t.n_send) {
    t.send[i] = item(0, i);
    return;
  }
  i -= t.n_send;
  if (i < t.n_unpack) t.unpack[i] = item(1, i);
  else t.bwd[i - t.n_unpack] = item(2, i - t.n_unpack);
}

template <typename Item>
void static_tables_cpu(const StaticTables& t, const Item& item) {
  for (int64_t i = 0; i < t.total(); ++i) static_tables_write(t, item, i);
}

}  // namespace packcuda::exchange
