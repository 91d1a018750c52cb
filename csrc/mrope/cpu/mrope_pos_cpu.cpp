#include <cstdint>

#include "mrope/mrope_pos.h"
#include "mrope/mrope_pos_math.h"

namespace packcuda::rope {
namespace {

// One sequential pass over the segments carrying the scan (runs started per modality, latest run start). With
// kWrite = false it checks every run at its last token and returns the first error (the earliest in the stream);
// with kWrite = true it writes the outputs (the input is known to be valid).
template <bool kWrite, typename I>
int64_t pass(int64_t* pos, int64_t* text_pos, int64_t* deltas, const I* ids, int64_t total, const MRopeTables& tb) {
  MRopeScan acc{0, -1};
  const MRopeScanOp op;
  for (int64_t seg = 0; seg < tb.nseg; ++seg) {
    const int64_t a = tb.cu[seg], end = tb.cu[seg + 1];
    const int64_t e0 = excess_before(acc, tb);
    int64_t dmax = INT64_MIN;
    int prev_ty = 0;
    int ty = a < end ? token_type(static_cast<int64_t>(ids[a]), tb) : 0;
    for (int64_t t = a; t < end; ++t) {
      const int next_ty = t + 1 < total ? token_type(static_cast<int64_t>(ids[t + 1]), tb) : 0;
      if (mrope_is_run_start(ty, prev_ty, t == a))
        acc = op(acc, MRopeScan{ty == 1 ? int64_t(1) : (int64_t(1) << 32), t});
      const bool run_end = t + 1 == end || next_ty != ty;
      if constexpr (kWrite) {
        int64_t p[3];
        mrope_positions(p, ty, t, a, acc, e0, tb);
        pos[t] = p[0];
        pos[total + t] = p[1];
        pos[2 * total + t] = p[2];
        text_pos[t] = t - a;
        if (run_end) {
          const int64_t d = mrope_delta(p, end - a);
          if (d > dmax) dmax = d;
        }
      } else if (ty != 0 && run_end) {
        const int m = ty - 1;
        const int64_t key = mrope_check_run(m, acc.start, t + 1, scan_count(acc, m) - 1, end, total, next_ty, tb);
        if (key != kMRopeOk) return key;
      }
      prev_ty = ty;
      ty = next_ty;
    }
    if constexpr (kWrite) deltas[seg] = end > a ? dmax : 0;
  }
  if constexpr (!kWrite) return mrope_check_counts(acc, tb, total);
  return kMRopeOk;
}

template <typename I>
int64_t run_cpu(int64_t* pos, int64_t* text_pos, int64_t* deltas, const I* ids, int64_t total, const MRopeTables& tb) {
  // every run against its block before anything is written
  const int64_t key = pass<false>(pos, text_pos, deltas, ids, total, tb);
  if (key != kMRopeOk) return key;
  return pass<true>(pos, text_pos, deltas, ids, total, tb);
}

}  // namespace

int64_t mrope_pos_cpu(int64_t* pos, int64_t* text_pos, int64_t* deltas, const void* ids, int id_elem_size,
                      int64_t total, const MRopeTables& tb) {
  if (id_elem_size == 4) return run_cpu(pos, text_pos, deltas, static_cast<const int32_t*>(ids), total, tb);
  return run_cpu(pos, text_pos, deltas, static_cast<const int64_t*>(ids), total, tb);
}

}  // namespace packcuda::rope
