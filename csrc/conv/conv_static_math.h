// Math of the conv-prefix tables of a static shard plan (shard/shard_math.h, "static plans"), shared by the CPU and
// CUDA kernels: the row exchange's fixed-size move (every rank sends every peer the same number of rows, one
// equal-split all-to-all) filled with the conv prefix's rows.
//
// Prefix slot q = k*(K-1) + j of piece k is padded offset off_k - (K-1) + j of the piece's segment (zero rows
// before the segment start). Sizes are fixed: every rank sends every peer one row per prefix slot of the
// peer's S pieces, SQ = S*(K-1) rows (the worst case; rows it does not hold are zero rows), with one equal-split
// all-to-all. Every rank knows every peer's pieces from the global cu_seqlens_padded:
//   zigzag: piece k = 2*seg + w of rank p starts at offset zigzag_rank_chunk(p, cp, w) * h_seg;
//   contiguous: piece 0 of rank p starts at its window start p*total_local (mid-segment or not); every other
//     piece starts at a segment start, where its prefix is all zero rows.
// Values are not trusted: any input gives -1 or an in-range row.
#pragma once
#include "../common/hd.h"
#include "../shard/shard_math.h"

namespace packcuda::conv {

using shard::kZigzag;
using shard::Location;
using shard::static_locate;
using shard::static_segments;
using shard::zigzag_chunk_rank;
using shard::zigzag_half_chunk;
using shard::zigzag_rank_chunk;

// Segment and start offset of piece k of rank p whose prefix may hold rows; false when it is all zero rows.
template <typename I>
PC_HD bool static_peer_piece(int layout, const I* cu_padded, int64_t max_seqs, int64_t cp, int64_t p,
                             int64_t total_local, int64_t k, int64_t* seg, int64_t* off) {
  if (layout == kZigzag) {
    const int64_t sg = k / 2;
    if (sg > max_seqs) return false;
    const int64_t len = static_cast<int64_t>(cu_padded[sg + 1]) - static_cast<int64_t>(cu_padded[sg]);
    *seg = sg;
    *off = zigzag_rank_chunk(p, cp, static_cast<int>(k % 2)) * zigzag_half_chunk(len < 0 ? 0 : len, cp);
    return true;
  }
  const int64_t nseg = static_segments(max_seqs), g0 = p * total_local;
  if (k != 0 || g0 < static_cast<int64_t>(cu_padded[0]) || g0 >= static_cast<int64_t>(cu_padded[nseg])) return false;
  *seg = find_segment(cu_padded, nseg, g0);
  *off = g0 - static_cast<int64_t>(cu_padded[*seg]);
  return true;
}

// Owner (rank, slot) of prefix row j of piece k of rank p; false for a zero row.
template <typename I>
PC_HD bool static_prefix_source(int layout, const I* cu_padded, int64_t max_seqs, int64_t cp, int64_t p,
                                int64_t total_local, int64_t k1, int64_t k, int64_t j, Location* loc) {
  int64_t seg = 0, off = 0;
  if (!static_peer_piece(layout, cu_padded, max_seqs, cp, p, total_local, k, &seg, &off)) return false;
  return off - k1 + j >= 0 && static_locate(layout, cu_padded, cp, total_local, seg, off - k1 + j, loc);
}

// send[p*SQ + q]: this rank's local row that fills prefix slot q of peer p (-1: a zero row from this rank).
template <typename I>
PC_HD int64_t static_send_row(int layout, const I* cu_padded, int64_t max_seqs, int64_t cp, int64_t rank,
                              int64_t total_local, int64_t k1, int64_t npieces, int64_t i) {
  const int64_t sq = npieces * k1, p = i / sq, q = i - p * sq;
  Location loc{0, 0};
  return static_prefix_source(layout, cu_padded, max_seqs, cp, p, total_local, k1, q / k1, q % k1, &loc) &&
                 loc.rank == rank
             ? loc.slot
             : -1;
}

// unpack[q]: the row of the received buffer ([cp*SQ], peer-major) that is this rank's prefix slot q (-1: zero).
template <typename I>
PC_HD int64_t static_unpack_row(int layout, const I* cu_padded, int64_t max_seqs, int64_t cp, int64_t rank,
                                int64_t total_local, int64_t k1, int64_t npieces, int64_t q) {
  Location loc{0, 0};
  return static_prefix_source(layout, cu_padded, max_seqs, cp, rank, total_local, k1, q / k1, q % k1, &loc)
             ? loc.rank * npieces * k1 + q
             : -1;
}

// bwd[s*(K-1) + d-1] (1 <= d <= K-1): the row of the gradient buffer sent back by the peers ([cp*SQ],
// peer-major, in the layout of send) that holds the gradient of the prefix slot reading local slot s as the
// row d before its piece's start (-1: none). Local slot s is padded offset o of segment seg (from this rank's
// pieces); the reader is the piece of some rank starting at offset o + d of seg.
template <typename I>
PC_HD int64_t static_bwd_row(int layout, const I* pieces, const int64_t* piece_offset, const I* piece_seq,
                             const I* cu_padded, int64_t max_seqs, int64_t cp, int64_t rank, int64_t total_local,
                             int64_t k1, int64_t npieces, int64_t s, int64_t d) {
  const int64_t k = find_segment(pieces, npieces, s);
  if (k < 0 || k >= npieces) return -1;
  const int64_t seg = piece_seq[k], po = piece_offset[k];
  if (seg < 0 || seg > max_seqs || po < 0 || po > (int64_t(1) << 40)) return -1;
  const int64_t t = po + (s - static_cast<int64_t>(pieces[k])) + d;  // offset of the reading piece's start
  const int64_t pb = cu_padded[seg], len = static_cast<int64_t>(cu_padded[seg + 1]) - pb;
  if (t <= 0 || t >= len) return -1;
  int64_t p = 0, kp = 0;
  if (layout == kZigzag) {
    const int64_t h = zigzag_half_chunk(len, cp);
    if (h <= 0 || t % h != 0) return -1;
    const int64_t c = t / h;
    p = zigzag_chunk_rank(c, cp);
    kp = 2 * seg + (c < cp ? 0 : 1);
  } else {
    const int64_t g = pb + t;
    if (total_local <= 0 || g % total_local != 0) return -1;
    p = g / total_local, kp = 0;
  }
  if (p < 0 || p >= cp || kp >= npieces) return -1;
  // the reader's prefix slot must read this very slot (consistent tables only)
  Location loc{0, 0};
  if (!static_prefix_source(layout, cu_padded, max_seqs, cp, p, total_local, k1, kp, k1 - d, &loc) ||
      loc.rank != rank || loc.slot != s)
    return -1;
  return p * npieces * k1 + kp * k1 + (k1 - d);
}

// The conv-prefix tables of one static plan (k1 = K-1 >= 1), as the static move's tables
// (exchange/exchange_static.h) with B = SQ = npieces * k1: send [cp * SQ], unpack [SQ], bwd [total_local, k1].
// item(table, i) is entry i of table 0 (send), 1 (unpack) or 2 (bwd).
struct StaticPrefix {
  const int32_t* pieces = nullptr;        // [npieces + 1] this rank's
  const int64_t* piece_offset = nullptr;  // [npieces]
  const int32_t* piece_seq = nullptr;     // [npieces]
  const int32_t* cu_padded = nullptr;     // [max_seqs + 2]
  int64_t max_seqs = 0, cp = 1, rank = 0, total_local = 0, k1 = 1, npieces = 0;
  int layout = kZigzag;
  PC_HD int64_t operator()(int table, int64_t i) const {
    if (table == 0) return static_send_row(layout, cu_padded, max_seqs, cp, rank, total_local, k1, npieces, i);
    if (table == 1) return static_unpack_row(layout, cu_padded, max_seqs, cp, rank, total_local, k1, npieces, i);
    return static_bwd_row(layout, pieces, piece_offset, piece_seq, cu_padded, max_seqs, cp, rank, total_local, k1,
                          npieces, i / k1, i % k1 + 1);
  }
};

}  // namespace packcuda::conv
