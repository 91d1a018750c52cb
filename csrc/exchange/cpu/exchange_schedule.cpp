// Host schedule of the row exchange: one rank's send / receive / unpack lists from a list of moves.
#include <algorithm>
#include <utility>

#include "common/errors.h"
#include "exchange/exchange.h"

namespace packcuda::exchange {
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

bool canonical_less(const Move& x, const Move& y) {
  return x.dst_rank != y.dst_rank ? x.dst_rank < y.dst_rank : x.dst_slot < y.dst_slot;
}

}  // namespace

Schedule build_schedule(const char* op, int64_t cp, int64_t rank, int64_t n_src, int64_t n_out,
                        std::vector<Move> moves) {
  PC_CHECK(cp >= 1 && cp <= kMaxCp, "packcuda.", op, ": cp must be in [1, ", kMaxCp, "], got ", cp);
  PC_CHECK(rank >= 0 && rank < cp, "packcuda.", op, ": rank ", rank, " is not in [0, cp=", cp, ")");
  PC_CHECK(n_src >= 0 && n_out >= 0, "packcuda.", op, ": n_src and n_out must be >= 0, got ", n_src, " and ", n_out);
  // The moves of this rank, checked.
  size_t kept = 0;
  for (size_t i = 0; i < moves.size(); ++i) {
    const Move& m = moves[i];
    PC_CHECK(m.src_rank >= 0 && m.src_rank < cp && m.dst_rank >= 0 && m.dst_rank < cp, "packcuda.", op, ": move ", i,
             " goes from rank ", m.src_rank, " to rank ", m.dst_rank, "; ranks must be in [0, cp=", cp, ")");
    PC_CHECK(m.src_row >= 0 && m.dst_slot >= 0, "packcuda.", op, ": move ", i, " has src_row ", m.src_row,
             " and dst_slot ", m.dst_slot, "; rows and slots must be >= 0");
    const bool sends = m.src_rank == rank, fills = m.dst_rank == rank;
    if (!sends && !fills) continue;
    PC_CHECK(!sends || m.src_row < n_src, "packcuda.", op, ": move ", i, " reads src_row ", m.src_row,
             " of this rank's source, which has n_src=", n_src, " rows");
    PC_CHECK(!fills || m.dst_slot < n_out, "packcuda.", op, ": move ", i, " fills dst_slot ", m.dst_slot,
             " of this rank's output, which has n_out=", n_out, " slots");
    moves[kept++] = m;
  }
  moves.resize(kept);
  // Canonical order (by dst_rank, then dst_slot): the order of the rows on the wire, which the sender and the
  // receiver derive alike. A slot has at most one source.
  if (!std::is_sorted(moves.begin(), moves.end(), canonical_less))
    std::stable_sort(moves.begin(), moves.end(), canonical_less);
  for (size_t i = 1; i < moves.size(); ++i)
    PC_CHECK(canonical_less(moves[i - 1], moves[i]), "packcuda.", op, ": slot ", moves[i].dst_slot, " of rank ",
             moves[i].dst_rank, " is filled by two moves (from rank ", moves[i - 1].src_rank, " row ",
             moves[i - 1].src_row, " and from rank ", moves[i].src_rank, " row ", moves[i].src_row,
             "); a slot has at most one source");

  Schedule sc;
  sc.cp = cp;
  sc.rank = rank;
  sc.n_src = n_src;
  sc.n_out = n_out;
  sc.send_counts.assign(cp, 0);
  sc.recv_counts.assign(cp, 0);
  sc.unpack.assign(n_out, -1);
  std::vector<std::vector<int64_t>> recv_slots(cp);
  for (const Move& m : moves) {  // canonical order: grouped by dst_rank, slots ascending
    if (m.src_rank == rank && m.dst_rank == rank) {
      sc.unpack[m.dst_slot] = m.src_row;  // stays local: copied, never sent
    } else if (m.src_rank == rank) {
      sc.send_index.push_back(m.src_row);
      ++sc.send_counts[m.dst_rank];
    } else {
      recv_slots[m.src_rank].push_back(m.dst_slot);
    }
  }
  int64_t recv_pos = 0;
  for (int64_t p = 0; p < cp; ++p) {
    sc.recv_counts[p] = static_cast<int64_t>(recv_slots[p].size());
    for (int64_t slot : recv_slots[p]) sc.unpack[slot] = n_src + recv_pos++;
    sc.bwd_send_index.insert(sc.bwd_send_index.end(), recv_slots[p].begin(), recv_slots[p].end());
  }
  // Reverse reduction lists: the slots a local row fed, in slot order, then the rows received back, in buffer
  // order (which is send_index order).
  std::vector<std::vector<int64_t>> contrib(n_src);
  for (int64_t j = 0; j < n_out; ++j)
    if (sc.unpack[j] >= 0 && sc.unpack[j] < n_src) contrib[sc.unpack[j]].push_back(j);
  for (int64_t i = 0; i < static_cast<int64_t>(sc.send_index.size()); ++i)
    contrib[sc.send_index[i]].push_back(n_out + i);
  sc.bwd_m = 1;
  for (const auto& c : contrib) sc.bwd_m = std::max<int64_t>(sc.bwd_m, static_cast<int64_t>(c.size()));
  sc.bwd_unpack.assign(n_src * sc.bwd_m, -1);
  for (int64_t r = 0; r < n_src; ++r)
    for (size_t m = 0; m < contrib[r].size(); ++m) sc.bwd_unpack[r * sc.bwd_m + m] = contrib[r][m];
  sc.send_first = first_rows(sc.send_index, sc.send_counts);
  sc.bwd_send_first = first_rows(sc.bwd_send_index, sc.recv_counts);
  return sc;
}

}  // namespace packcuda::exchange
