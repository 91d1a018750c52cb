// Torch layer of the row exchange, for the other torch-layer files that build schedules (conv_prefix_schedule,
// relayout_schedule): one output format for every schedule op. Not installed (a torch-layer header).
#pragma once
#include <vector>

#include "common/torch/checks.h"
#include "exchange/exchange.h"

namespace packcuda::th {

// A schedule as host int64 tensors, in this order (packcuda/exchange.py reads them by these positions):
// send_index, send_counts, recv_counts, unpack [n_out], bwd_send_index, bwd_unpack [n_src, bwd_m],
// info (cp, rank, n_src, n_out), send_first, bwd_send_first.
std::vector<Tensor> schedule_tensors(const exchange::Schedule& sc);

// cp_size <= exchange::kMaxCp (a schedule keeps lists for every peer), refused naming op and `name`.
void check_schedule_cp(const char* op, const char* name, int64_t cp_size);

}  // namespace packcuda::th
