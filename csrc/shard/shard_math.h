// Layout math of context-parallel shard plans, shared by the CPU and CUDA kernels (and by any op that
// needs to know where a token of the padded stream lives, e.g. exchanges between CP ranks).
//
// Vocabulary
//   cu          [nseq+1]  boundaries of the original (unpadded) packed stream; sequence i has rows
//                         [cu[i], cu[i+1]) and real length L_i = cu[i+1] - cu[i].
//   cu_padded   [nseg+1]  boundaries of the padded stream. Segment i < nseq is sequence i padded at its tail
//                         to P_i = round_up(L_i, align); when nseg == nseq + 1 the last segment is the
//                         bucket pad segment (no real rows).
//   padded offset o       offset of a token inside its padded segment, 0 <= o < P_i; o >= L_i is padding.
//   cp, rank              context-parallel world size and this rank.
//   total_local           rows of every rank's local buffer (total_padded / cp).
//
// Layouts
//   zigzag (kZigzag): segment i is cut into 2*cp chunks of h_i = P_i / (2*cp) rows; chunk c belongs to
//     rank c for c < cp and to rank 2*cp-1-c otherwise. Rank r stores, segment after segment, chunk r then
//     chunk 2*cp-1-r; segment i starts at local slot cu_padded[i] / cp.
//   contiguous (kContiguous): the padded stream is cut into cp windows of total_local rows; rank r stores
//     global padded rows [r*total_local, (r+1)*total_local).
#pragma once
#include "../common/hd.h"

namespace packcuda::shard {

enum Layout : int { kZigzag = 0, kContiguous = 1 };

// ---- per-segment sizes ------------------------------------------------------------------------------

// Padded length of a sequence of `len` real tokens (round_up(len, align)).
PC_HD int64_t padded_length(int64_t len, int64_t align) { return div_nonneg(len + align - 1, align) * align; }

// Zigzag half-chunk h_i of a padded segment (P_i is a multiple of 2*cp).
PC_HD int64_t zigzag_half_chunk(int64_t padded_len, int64_t cp) { return div_nonneg(padded_len, 2 * cp); }

// ---- zigzag chunk <-> rank ------------------------------------------------------------------------------

// Rank owning zigzag chunk c (0 <= c < 2*cp).
PC_HD int64_t zigzag_chunk_rank(int64_t c, int64_t cp) { return c < cp ? c : 2 * cp - 1 - c; }

// Chunk held by `rank` in its first (which = 0) or second (which = 1) half of a segment.
PC_HD int64_t zigzag_rank_chunk(int64_t rank, int64_t cp, int which) { return which == 0 ? rank : 2 * cp - 1 - rank; }

// Local slot, relative to the segment's local start, of padded offset o of chunk c (the chunk's rank
// stores its first chunk in [0, h) and its second in [h, 2h)).
PC_HD int64_t zigzag_slot_in_segment(int64_t o, int64_t c, int64_t h, int64_t cp) {
  return (c < cp ? 0 : h) + (o - c * h);
}

// ---- contiguous windows ----------------------------------------------------------------------------------

// Global padded rows [window_begin, window_begin + total_local) held by `rank`.
PC_HD int64_t contiguous_window_begin(int64_t rank, int64_t total_local) { return rank * total_local; }

// ---- what a local slot holds ----------------------------------------------------------------------------

struct SlotSource {
  int64_t row;        // original row of the token, -1 for padding
  int64_t position;   // padded offset inside its segment (pads keep counting; the bucket segment from 0)
  int64_t label_row;  // original row of the next token of the same sequence, -1 at the last token / pads
};

// Token at padded offset o of segment seg. Segments seg >= nseq (the bucket pad segment) hold no rows.
template <typename I>
PC_HD SlotSource segment_slot_source(const I* cu, int64_t nseq, int64_t seg, int64_t o) {
  SlotSource s{-1, o, -1};
  if (seg < nseq) {
    const int64_t start = static_cast<int64_t>(cu[seg]);
    const int64_t len = static_cast<int64_t>(cu[seg + 1]) - start;
    if (o < len) s.row = start + o;
    if (o + 1 < len) s.label_row = start + o + 1;
  }
  return s;
}

// Local slot s of a rank described by its pieces (runs of consecutive padded offsets of one segment):
// piece k covers local slots [pieces[k], pieces[k+1]), starting at padded offset piece_offset[k] of segment
// piece_seq[k]. Binary search over the npieces pieces; empty pieces are skipped.
template <typename I, typename P>
PC_HD SlotSource local_slot_source(const I* cu, int64_t nseq, const P* pieces, const P* piece_offset,
                                   const P* piece_seq, int64_t npieces, int64_t s) {
  const int64_t k = find_segment(pieces, npieces, s);
  const int64_t o = static_cast<int64_t>(piece_offset[k]) + (s - static_cast<int64_t>(pieces[k]));
  return segment_slot_source(cu, nseq, static_cast<int64_t>(piece_seq[k]), o);
}

// The per-slot tables of local slot s: index (source row), position, label_index (label source row).
template <typename I, typename P>
PC_HD void write_slot_tables(int64_t* index, int64_t* position, int64_t* label_index, const I* cu, int64_t nseq,
                             const P* pieces, const P* piece_offset, const P* piece_seq, int64_t npieces,
                             int64_t s) {
  const SlotSource src = local_slot_source(cu, nseq, pieces, piece_offset, piece_seq, npieces, s);
  index[s] = src.row;
  position[s] = src.position;
  label_index[s] = src.label_row;
}

// ---- inverse: where does a padded token live? -------------------------------------------------------

struct Location {
  int64_t rank;  // CP rank that stores the token
  int64_t slot;  // its row in that rank's local buffer, 0 <= slot < total_local
};

// Owner of padded offset o (0 <= o < P_seg) of segment seg, for either layout.
template <typename I>
PC_HD Location locate(int layout, const I* cu_padded, int64_t cp, int64_t total_local, int64_t seg, int64_t o) {
  const int64_t begin = static_cast<int64_t>(cu_padded[seg]);
  if (layout == kContiguous) {
    const int64_t g = begin + o;
    const int64_t r = g / total_local;
    return Location{r, g - r * total_local};
  }
  const int64_t h = zigzag_half_chunk(static_cast<int64_t>(cu_padded[seg + 1]) - begin, cp);
  const int64_t c = o / h;
  return Location{zigzag_chunk_rank(c, cp), begin / cp + zigzag_slot_in_segment(o, c, h, cp)};
}

// Row of original token t in the concatenation of all ranks' local buffers ([cp * total_local] rows,
// rank-major, as produced by an all-gather).
template <typename I, typename J>
PC_HD int64_t unshard_slot(int layout, const I* cu, int64_t nseq, const J* cu_padded, int64_t cp,
                           int64_t total_local, int64_t t) {
  const int64_t seg = find_segment(cu, nseq, t);
  const Location loc = locate(layout, cu_padded, cp, total_local, seg, t - static_cast<int64_t>(cu[seg]));
  return loc.rank * total_local + loc.slot;
}

}  // namespace packcuda::shard
