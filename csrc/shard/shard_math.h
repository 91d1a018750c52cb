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

// ---- one segment of a rank's layout ---------------------------------------------------------------------
// The host layout (build_layout) and the static device plan (static_build_cpu / _cuda) are the same formulas: both
// walk the segments and call these.

// Pad rows the bucket segment adds to a padded stream of seq_total rows (unit: bucket, or lcm(bucket, cp)
// for the contiguous layout).
PC_HD int64_t bucket_pad_length(int64_t seq_total, int64_t unit) { return round_up(seq_total, unit) - seq_total; }

// Most pieces a rank can have with nseg segments (zigzag: two per segment; contiguous: one per segment
// that meets the rank's window).
PC_HD int64_t max_pieces(int layout, int64_t nseg) { return layout == kZigzag ? 2 * nseg : nseg; }

// Pieces segment [pb, pe) of the padded stream gives `rank` (zigzag: 2, possibly empty; contiguous: 1
// when it meets the rank's window, else 0).
PC_HD int64_t segment_piece_count(int layout, int64_t pb, int64_t pe, int64_t rank, int64_t total_local) {
  if (layout == kZigzag) return 2;
  const int64_t lo = contiguous_window_begin(rank, total_local), hi = lo + total_local;
  return (pb > lo ? pb : lo) < (pe < hi ? pe : hi) ? 1 : 0;
}

// Writes what segment seg = [pb, pe) of the padded stream contributes to `rank`'s layout: its local end
// cu_local[seg + 1] and its pieces at entries np.. (pieces[np + 1..], piece_offset[np..], piece_seq[np..];
// pieces[np] is the previous piece's end). Returns the number of pieces written (segment_piece_count).
template <typename T, typename O>
PC_HD int64_t write_segment_layout(int layout, int64_t seg, int64_t pb, int64_t pe, int64_t cp, int64_t rank,
                                   int64_t total_local, int64_t np, T* cu_local, T* pieces, O* piece_offset,
                                   T* piece_seq) {
  if (layout == kZigzag) {
    // segment i holds 2*h_i local rows starting at cu_padded[i] / cp
    const int64_t hc = zigzag_half_chunk(pe - pb, cp), lb = div_nonneg(pb, cp);
    cu_local[seg + 1] = static_cast<T>(lb + 2 * hc);
    piece_offset[np] = static_cast<O>(zigzag_rank_chunk(rank, cp, 0) * hc);
    piece_offset[np + 1] = static_cast<O>(zigzag_rank_chunk(rank, cp, 1) * hc);
    piece_seq[np] = piece_seq[np + 1] = static_cast<T>(seg);
    pieces[np + 1] = static_cast<T>(lb + hc);
    pieces[np + 2] = static_cast<T>(lb + 2 * hc);
    return 2;
  }
  const int64_t lo = contiguous_window_begin(rank, total_local), hi = lo + total_local;
  cu_local[seg + 1] = static_cast<T>((pe < lo ? lo : pe > hi ? hi : pe) - lo);
  const int64_t a = pb > lo ? pb : lo, b = pe < hi ? pe : hi;
  if (a >= b) return 0;
  piece_offset[np] = static_cast<O>(a - pb);
  piece_seq[np] = static_cast<T>(seg);
  pieces[np + 1] = static_cast<T>(b - lo);
  return 1;
}

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
                             const P* pieces, const P* piece_offset, const P* piece_seq, int64_t npieces, int64_t s) {
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

// Padded row (of the whole padded stream, cu_padded [nseg + 1]) that `rank` holds at local slot `slot`: the
// inverse of locate. -1 for a slot past the stream (and, for values not trusted, whatever does not fit a
// layout: callers that index with the result check it with locate / static_locate).
template <typename I>
PC_HD int64_t padded_row(int layout, const I* cu_padded, int64_t nseg, int64_t cp, int64_t total_local, int64_t rank,
                         int64_t slot) {
  const int64_t end = static_cast<int64_t>(cu_padded[nseg]);
  if (slot < 0 || slot >= total_local) return -1;
  if (layout == kContiguous) {
    const int64_t g = contiguous_window_begin(rank, total_local) + slot;
    return g < end ? g : -1;
  }
  // zigzag: segment i starts at local slot cu_padded[i] / cp on every rank (its length is a multiple of 2*cp)
  if (slot * cp >= end) return -1;
  const int64_t seg = find_segment(cu_padded, nseg, slot * cp);
  const int64_t begin = static_cast<int64_t>(cu_padded[seg]);
  const int64_t h = zigzag_half_chunk(static_cast<int64_t>(cu_padded[seg + 1]) - begin, cp);
  const int64_t o = slot - begin / cp;  // in [0, 2h) for consistent tables
  if (h <= 0 || o < 0 || o >= 2 * h) return -1;
  const int which = o < h ? 0 : 1;
  return begin + zigzag_rank_chunk(rank, cp, which) * h + (o - which * h);
}

// Row of original token t in the concatenation of all ranks' local buffers ([cp * total_local] rows,
// rank-major, as produced by an all-gather).
template <typename I, typename J>
PC_HD int64_t unshard_slot(int layout, const I* cu, int64_t nseq, const J* cu_padded, int64_t cp, int64_t total_local,
                           int64_t t) {
  const int64_t seg = find_segment(cu, nseq, t);
  const Location loc = locate(layout, cu_padded, cp, total_local, seg, t - static_cast<int64_t>(cu[seg]));
  return loc.rank * total_local + loc.slot;
}

// ---- static plans (fixed shapes, built on the device) ---------------------------------------------------
// A static plan of max_seqs sequences and `capacity` padded rows has max_seqs + 1 segments: sequence i < n
// (n = num_seqs), then the bucket pad segment (index n, capacity - padded total rows, possibly empty), then
// empty segments at the end. It equals the host plan of the n sequences with bucket = capacity on
// everything the host plan has; its extra pieces are empty.

// The flags of a static plan's status. The names (kStaticStatusFlagNames, same order, bit k = 1 << k) are what
// Python reads them by (shard_plan_fields).
enum StaticStatus : int64_t {
  kStaticOverCapacity = 1,  // padded total > capacity
  kStaticTooManySeqs = 2,   // num_seqs outside [0, max_seqs]
  kStaticBadCu = 4,         // cu_seqlens[0] != 0 or decreasing within the first num_seqs + 1 entries
};
constexpr const char* kStaticStatusFlagNames[] = {"over_capacity", "too_many_seqs", "bad_cu"};
static_assert(sizeof(kStaticStatusFlagNames) / sizeof(kStaticStatusFlagNames[0]) == 3 &&
                  kStaticOverCapacity == 1 << 0 && kStaticTooManySeqs == 1 << 1 && kStaticBadCu == 1 << 2,
              "one name per flag, in bit order");
// status[kStaticStatusLen] of a static plan: the flags, num_seqs as given, the padded total the sequences need
// (exact while every sequence is shorter than 2**31 rows, a lower bound otherwise), the first bad cu entry (-1:
// none); named by kStaticStatusNames.
enum StaticStatusEntry : int { kStatusFlags, kStatusNumSeqs, kStatusPaddedTotal, kStatusFirstBadCu, kStaticStatusLen };
constexpr const char* kStaticStatusNames[kStaticStatusLen] = {"flags", "num_seqs", "padded_total", "first_bad_cu"};

// Segment count and piece count of a static plan.
PC_HD int64_t static_segments(int64_t max_seqs) { return max_seqs + 1; }
PC_HD int64_t static_pieces(int layout, int64_t max_seqs) { return max_pieces(layout, static_segments(max_seqs)); }

// int32 or int64 values on either side (the static plan's inputs keep the caller's dtype).
struct IntView {
  const int32_t* p32 = nullptr;
  const int64_t* p64 = nullptr;
  PC_HD int64_t operator[](int64_t i) const { return p64 != nullptr ? p64[i] : static_cast<int64_t>(p32[i]); }
};

// One static plan build: inputs, sizes and the layout outputs (the per-slot tables then come from
// plan_tables over these outputs, with nseq = max_seqs and cu = cu_clean).
struct StaticBuild {
  IntView cu;              // [max_seqs + 1] the caller's cu_seqlens (entries past num_seqs are not read)
  IntView num_seqs;        // device num_seqs (0-dim), or both null: num_seqs_host
  int64_t num_seqs_host = 0;
  int64_t max_seqs = 0, cp = 1, rank = 0, align = 1, capacity = 0, total_local = 0, npieces = 0;
  int layout = kZigzag;
  int32_t* cu_clean = nullptr;      // [max_seqs + 1] cu[min(i, n)] (all 0 when the batch is refused)
  int32_t* cu_padded = nullptr;     // [max_seqs + 2]
  int32_t* cu_local = nullptr;      // [max_seqs + 2]
  int32_t* pieces = nullptr;        // [npieces + 1]
  int32_t* piece_offset = nullptr;  // [npieces]
  int32_t* piece_seq = nullptr;     // [npieces]
  int64_t* status = nullptr;        // [kStaticStatusLen]
};

PC_HD int64_t static_num_seqs(const StaticBuild& b) {
  return b.num_seqs.p32 != nullptr || b.num_seqs.p64 != nullptr ? b.num_seqs[0] : b.num_seqs_host;
}

// Saturating sum of non-negative padded lengths (order-independent: min(true sum, kStaticSumCap)).
constexpr int64_t kStaticSumCap = int64_t(1) << 62;
PC_HD int64_t static_sum(int64_t a, int64_t b) { return a >= kStaticSumCap - b ? kStaticSumCap : a + b; }

// Padded length sequence i contributes to the capacity check (its length clamped to kStaticLenCap, past any
// capacity), or -1 when cu decreases there.
constexpr int64_t kStaticLenCap = int64_t(1) << 31;
PC_HD int64_t static_checked_length(const StaticBuild& b, int64_t i) {
  const int64_t lo = b.cu[i], hi = b.cu[i + 1];
  if (hi < lo) return -1;
  // hi - lo is compared without overflowing: for lo <= 0, hi - lo > cap iff hi > lo + cap
  const bool big = lo > 0 ? hi - lo > kStaticLenCap : hi > lo + kStaticLenCap;
  return padded_length(big ? kStaticLenCap : hi - lo, b.align);
}

// The outcome of the checks: flags (StaticStatus) from num_seqs as given, the saturated padded total and the
// first bad cu entry (-1: none).
struct StaticCheck {
  int64_t flags, n, seq_total;
  PC_HD bool ok() const { return flags == 0; }
  PC_HD int64_t n_eff() const { return ok() ? n : 0; }            // sequences the plan lays out
  PC_HD int64_t total_eff() const { return ok() ? seq_total : 0; }  // their padded total
};
PC_HD bool static_num_seqs_ok(const StaticBuild& b, int64_t n) { return n >= 0 && n <= b.max_seqs; }
PC_HD StaticCheck static_check(const StaticBuild& b, int64_t n_in, int64_t sum, int64_t first_bad) {
  int64_t flags = static_num_seqs_ok(b, n_in) ? 0 : int64_t{kStaticTooManySeqs};
  if (first_bad >= 0) flags |= kStaticBadCu;
  if (sum > b.capacity) flags |= kStaticOverCapacity;
  return StaticCheck{flags, n_in, sum};
}
// The status and the first entry of every boundary table (one writer).
PC_HD void static_write_head(const StaticBuild& b, const StaticCheck& c, int64_t first_bad) {
  b.status[kStatusFlags] = c.flags;
  b.status[kStatusNumSeqs] = c.n;
  b.status[kStatusPaddedTotal] = c.seq_total;
  b.status[kStatusFirstBadCu] = first_bad;
  b.cu_padded[0] = b.cu_local[0] = b.pieces[0] = 0;
}

// Padded length of segment i of the static plan (sequence, bucket pad segment, or an empty trailing one).
PC_HD int64_t static_segment_length(const StaticBuild& b, const StaticCheck& c, int64_t i) {
  const int64_t n = c.n_eff();
  if (i < n) return padded_length(b.cu[i + 1] - b.cu[i], b.align);
  return i == n ? b.capacity - c.total_eff() : 0;
}

// Writes segment i = [pb, pe) of the static plan (its first piece is np): cu_clean[i], cu_padded[i + 1] and
// the segment's local layout. Returns its piece count.
PC_HD int64_t static_write_segment(const StaticBuild& b, const StaticCheck& c, int64_t i, int64_t pb, int64_t pe,
                                   int64_t np) {
  const int64_t n = c.n_eff();
  b.cu_clean[i] = c.ok() ? static_cast<int32_t>(b.cu[i < n ? i : n]) : 0;
  b.cu_padded[i + 1] = static_cast<int32_t>(pe);
  return write_segment_layout(b.layout, i, pb, pe, b.cp, b.rank, b.total_local, np, b.cu_local, b.pieces,
                              b.piece_offset, b.piece_seq);
}

// Piece k past the last real one: an empty piece at the end of the local buffer (of the last segment).
PC_HD void static_fill_piece(const StaticBuild& b, int64_t k) {
  b.pieces[k + 1] = static_cast<int32_t>(b.total_local);
  b.piece_offset[k] = 0;
  b.piece_seq[k] = static_cast<int32_t>(b.max_seqs);
}

// Where padded offset o of segment seg lives (rank, slot), or false when o is outside the segment (or the
// tables are inconsistent).
template <typename I>
PC_HD bool static_locate(int layout, const I* cu_padded, int64_t cp, int64_t total_local, int64_t seg, int64_t o,
                         Location* loc) {
  const int64_t pb = cu_padded[seg], pe = cu_padded[seg + 1];
  if (o < 0 || pb < 0 || o >= pe - pb || (layout == kZigzag && (pe - pb) % (2 * cp) != 0)) return false;
  *loc = locate(layout, cu_padded, cp, total_local, seg, o);
  return loc->rank >= 0 && loc->rank < cp && loc->slot >= 0 && loc->slot < total_local;
}

// Row of original token t (t < capacity) in the rank-major concatenation of all local buffers of a static
// plan (cu [max_seqs + 1], cu_padded [max_seqs + 2]), -1 past the real tokens. Values are not trusted: any
// input gives -1 or a row in [0, capacity).
template <typename I>
PC_HD int64_t static_unshard_slot(int layout, const I* cu, int64_t max_seqs, const I* cu_padded, int64_t cp,
                                  int64_t total_local, int64_t t) {
  if (t < static_cast<int64_t>(cu[0]) || t >= static_cast<int64_t>(cu[max_seqs])) return -1;
  const int64_t seg = find_segment(cu, max_seqs, t);
  const int64_t o = t - static_cast<int64_t>(cu[seg]);
  Location loc{0, 0};
  return static_locate(layout, cu_padded, cp, total_local, seg, o, &loc) ? loc.rank * total_local + loc.slot : -1;
}

}  // namespace packcuda::shard
