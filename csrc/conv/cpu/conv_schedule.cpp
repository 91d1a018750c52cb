// Host schedule of the conv-prefix exchange, derived from the shard plan layout (shard::build_layout for every
// rank, shard::locate for each prefix row).
#include <algorithm>

#include "conv/conv.h"
#include "shard/shard.h"
#include "shard/shard_math.h"

namespace packcuda::conv {
namespace {

// Per peer p (counts[p] rows of index, grouped by peer): the first row when those rows are consecutive, else -1.
std::vector<int64_t> first_rows(const std::vector<int64_t>& index, const std::vector<int64_t>& counts) {
  std::vector<int64_t> first(counts.size(), -1);
  int64_t o = 0;
  for (size_t p = 0; p < counts.size(); ++p) {
    const int64_t c = counts[p];
    bool run = c > 0;
    for (int64_t i = 1; run && i < c; ++i) run = index[o + i] == index[o] + i;
    if (run) first[p] = index[o];
    o += c;
  }
  return first;
}

}  // namespace

Schedule build_schedule(const int64_t* cu, int64_t nseq, int64_t cp, int64_t rank, int layout, int64_t align,
                        int64_t bucket, int K) {
  Schedule sc;
  sc.cp = cp;
  sc.rank = rank;
  sc.K = K;
  const int64_t W = K - 1;  // prefix rows per piece
  std::vector<std::vector<int64_t>> send_rows(cp), recv_slots(cp);
  std::vector<std::pair<int64_t, int64_t>> local;  // (prefix slot, local row)
  shard::HostLayout mine;
  for (int64_t q = 0; q < cp; ++q) {
    shard::HostLayout h = shard::build_layout(cu, nseq, cp, q, layout, align, bucket);
    const int64_t np = static_cast<int64_t>(h.piece_offset.size());
    // Pieces of rank q in order, prefix rows in order: the sender (rank r) and the receiver (rank q) walk the
    // same list, so the rows r sends to q arrive in the order q expects them.
    for (int64_t k = 0; k < np; ++k) {
      if (h.pieces[k + 1] == h.pieces[k]) continue;  // empty piece: its prefix is never read
      const int64_t seg = h.piece_seq[k], o = h.piece_offset[k];
      for (int64_t j = 0; j < W; ++j) {
        const int64_t oo = o - W + j;
        if (oo < 0) continue;  // before the segment start: a zero row
        const shard::Location loc = shard::locate(layout, h.cu_padded.data(), cp, h.total_local, seg, oo);
        if (q == rank) {
          if (loc.rank == rank) local.emplace_back(k * W + j, loc.slot);
          else recv_slots[loc.rank].push_back(k * W + j);
        } else if (loc.rank == rank) {
          send_rows[q].push_back(loc.slot);
        }
      }
    }
    if (q == rank) mine = std::move(h);
  }
  sc.n_pieces = static_cast<int64_t>(mine.piece_offset.size());
  sc.n_local = mine.total_local;
  const int64_t n_slots = sc.n_pieces * W;
  sc.send_counts.assign(cp, 0);
  sc.recv_counts.assign(cp, 0);
  sc.unpack.assign(n_slots, -1);
  for (const auto& [slot, row] : local) sc.unpack[slot] = row;
  int64_t recv_pos = 0;
  for (int64_t p = 0; p < cp; ++p) {
    sc.send_counts[p] = static_cast<int64_t>(send_rows[p].size());
    sc.recv_counts[p] = static_cast<int64_t>(recv_slots[p].size());
    sc.send_index.insert(sc.send_index.end(), send_rows[p].begin(), send_rows[p].end());
    for (int64_t slot : recv_slots[p]) sc.unpack[slot] = sc.n_local + recv_pos++;
    sc.bwd_send_index.insert(sc.bwd_send_index.end(), recv_slots[p].begin(), recv_slots[p].end());
  }
  // Backward reduction lists: local contributions in prefix-slot order, then received rows in buffer order.
  std::vector<std::vector<int64_t>> contrib(sc.n_local);
  for (int64_t j = 0; j < n_slots; ++j)
    if (sc.unpack[j] >= 0 && sc.unpack[j] < sc.n_local) contrib[sc.unpack[j]].push_back(j);
  for (int64_t i = 0; i < static_cast<int64_t>(sc.send_index.size()); ++i)
    contrib[sc.send_index[i]].push_back(n_slots + i);
  sc.bwd_m = 1;
  for (const auto& c : contrib) sc.bwd_m = std::max<int64_t>(sc.bwd_m, static_cast<int64_t>(c.size()));
  sc.bwd_unpack.assign(sc.n_local * sc.bwd_m, -1);
  for (int64_t r = 0; r < sc.n_local; ++r)
    for (size_t m = 0; m < contrib[r].size(); ++m) sc.bwd_unpack[r * sc.bwd_m + m] = contrib[r][m];
  sc.send_first = first_rows(sc.send_index, sc.send_counts);
  sc.bwd_send_first = first_rows(sc.bwd_send_index, sc.recv_counts);
  return sc;
}

}  // namespace packcuda::conv
