#include <cstdint>

#include "rope/mrope_pos.h"
#include "rope/mrope_pos_math.h"

namespace packcuda::rope {
namespace {

template <typename I>
int64_t run_cpu(int64_t* pos, int64_t* text_pos, int64_t* deltas, MRopeScan* scan, const I* ids, int64_t total,
                const MRopeTables& tb) {
  // 1. inclusive scan of the run starts
  MRopeScan acc{0, -1};
  const MRopeScanOp op;
  for (int64_t t = 0; t < total; ++t) {
    acc = op(acc, mrope_scan_input(ids, t, tb));
    scan[t] = acc;
  }
  // 2. every run against its block, before anything is written; the first error in the stream wins
  for (int64_t t = 0; t < total; ++t) {
    if (scan[t].start != t) continue;
    const int64_t key = mrope_check_start(ids, scan, tb, t, total);
    if (key != kMRopeOk) return key;
  }
  const int64_t key = total > 0 ? mrope_check_counts(scan[total - 1], tb, total)
                                : mrope_check_counts(MRopeScan{0, -1}, tb, 0);
  if (key != kMRopeOk) return key;
  // 3. outputs
  for (int64_t s = 0; s < tb.nseg; ++s) deltas[s] = tb.cu[s + 1] > tb.cu[s] ? INT64_MIN : 0;
  for (int64_t t = 0; t < total; ++t) {
    const MRopeToken o = mrope_token(ids, scan, tb, t, total);
    pos[t] = o.p[0];
    pos[total + t] = o.p[1];
    pos[2 * total + t] = o.p[2];
    text_pos[t] = o.local;
    if (o.run_end) {
      const int64_t d = max3(o.p[0], o.p[1], o.p[2]) + 1 - o.seg_len;
      if (d > deltas[o.seg]) deltas[o.seg] = d;
    }
  }
  return kMRopeOk;
}

}  // namespace

int64_t mrope_pos_cpu(int64_t* pos, int64_t* text_pos, int64_t* deltas, MRopeScan* scratch, const void* ids,
                      int id_elem_size, int64_t total, const MRopeTables& tb) {
  if (id_elem_size == 4)
    return run_cpu(pos, text_pos, deltas, scratch, static_cast<const int32_t*>(ids), total, tb);
  return run_cpu(pos, text_pos, deltas, scratch, static_cast<const int64_t*>(ids), total, tb);
}

}  // namespace packcuda::rope
