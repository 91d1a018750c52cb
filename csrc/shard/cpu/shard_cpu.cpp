#include <algorithm>
#include <cstring>
#include <numeric>

#include "common/checked.h"
#include "shard/shard.h"
#include "shard/shard_math.h"

namespace packcuda::shard {

int64_t checked_padded_total(const char* op, const int64_t* cu, int64_t nseq, int64_t cp, int layout, int64_t align,
                             int64_t bucket) {
  int64_t seq_total = 0;
  for (int64_t i = 0; i < nseq; ++i) {
    const int64_t p = checked::round_up(op, "a padded sequence length", cu[i + 1] - cu[i], align);
    seq_total = checked::add(op, "the padded stream length", seq_total, p);
    // stop at the first sequence past the limit (later sums cannot come back below it)
    PC_CHECK(seq_total <= kMaxPaddedTotal, "packcuda.", op, ": the padded stream (", seq_total,
             "+ tokens after sequence ", i, ") does not fit int32 boundaries (at most ", kMaxPaddedTotal, ")");
  }
  const int64_t unit =
      layout == kContiguous ? checked::mul(op, "lcm(bucket, cp_size)", bucket / std::gcd(bucket, cp), cp) : bucket;
  const int64_t total = checked::round_up(op, "the bucketed padded total", seq_total, unit);
  PC_CHECK(total <= kMaxPaddedTotal, "packcuda.", op, ": the padded stream (", total, " tokens, ", seq_total,
           " before rounding up to a multiple of ", unit, ") does not fit int32 boundaries (at most ",
           kMaxPaddedTotal, ")");
  return total;
}

HostLayout build_layout(const int64_t* cu, int64_t nseq, int64_t cp, int64_t rank, int layout, int64_t align,
                        int64_t bucket) {
  HostLayout h;
  h.total = cu[nseq];
  h.cu_padded.reserve(nseq + 2);
  h.cu_padded.resize(nseq + 1);
  h.cu_padded[0] = 0;
  for (int64_t i = 0; i < nseq; ++i) {
    const int64_t p = padded_length(cu[i + 1] - cu[i], align);
    h.cu_padded[i + 1] = h.cu_padded[i] + p;
    h.max_seqlen_padded = std::max(h.max_seqlen_padded, p);
  }
  const int64_t unit = layout == kContiguous ? std::lcm(bucket, cp) : bucket;
  const int64_t seq_total = h.cu_padded[nseq];
  h.total_padded = round_up(seq_total, unit);
  h.pad_size = h.total_padded - seq_total;
  if (h.pad_size > 0) {
    h.cu_padded.push_back(h.total_padded);
    h.max_seqlen_padded = std::max(h.max_seqlen_padded, h.pad_size);
  }
  const int64_t nseg = static_cast<int64_t>(h.cu_padded.size()) - 1;
  h.total_local = h.total_padded / cp;
  h.cu_local.resize(nseg + 1);
  // sized up front and written by index (push_back costs several times more on this per-batch host path)
  const int64_t max_pieces = layout == kZigzag ? 2 * nseg : nseg;
  h.pieces.resize(max_pieces + 1);
  h.piece_offset.resize(max_pieces);
  h.piece_seq.resize(max_pieces);
  int64_t* pieces = h.pieces.data();
  int64_t* piece_offset = h.piece_offset.data();
  int64_t* piece_seq = h.piece_seq.data();
  const int64_t* cu_padded = h.cu_padded.data();
  int64_t* cu_local = h.cu_local.data();
  pieces[0] = 0;
  int64_t np = 0;
  if (layout == kZigzag) {
    // segment i holds 2*h_i local rows, so cu_local[i] = cu_padded[i] / cp accumulates without dividing
    const int64_t first = zigzag_rank_chunk(rank, cp, 0), second = zigzag_rank_chunk(rank, cp, 1);
    cu_local[0] = 0;
    for (int64_t i = 0; i < nseg; ++i) {
      const int64_t hc = zigzag_half_chunk(cu_padded[i + 1] - cu_padded[i], cp);
      cu_local[i + 1] = cu_local[i] + 2 * hc;
      piece_offset[np] = first * hc;
      piece_offset[np + 1] = second * hc;
      piece_seq[np] = piece_seq[np + 1] = i;
      pieces[np + 1] = cu_local[i] + hc;
      pieces[np + 2] = cu_local[i + 1];
      np += 2;
    }
  } else {
    const int64_t lo = contiguous_window_begin(rank, h.total_local), hi = lo + h.total_local;
    for (int64_t i = 0; i <= nseg; ++i) cu_local[i] = std::clamp(cu_padded[i], lo, hi) - lo;
    for (int64_t i = 0; i < nseg; ++i) {
      const int64_t a = std::max(cu_padded[i], lo), b = std::min(cu_padded[i + 1], hi);
      if (a >= b) continue;
      piece_offset[np] = a - cu_padded[i];
      piece_seq[np] = i;
      pieces[np + 1] = pieces[np] + (b - a);
      ++np;
    }
    h.pieces.resize(np + 1);
    h.piece_offset.resize(np);
    h.piece_seq.resize(np);
  }
  return h;
}

void plan_index_cpu(int64_t* index, int64_t* position, int64_t* label_index, int64_t total_local,
                    const int64_t* cu, int64_t nseq, const int64_t* pieces, const int64_t* piece_offset,
                    const int64_t* piece_seq, int64_t npieces) {
  for (int64_t s = 0; s < total_local; ++s)
    write_slot_tables(index, position, label_index, cu, nseq, pieces, piece_offset, piece_seq, npieces, s);
}

void plan_tables_cpu(const PlanTables& p) {
  for (int64_t s = 0; s < p.total_local; ++s)
    write_slot_tables(p.index, p.position, p.label_index, p.cu, p.nseq, p.pieces, p.piece_offset, p.piece_seq,
                      p.npieces, s);
  for (int64_t k = 0; k < p.npieces; ++k) p.piece_offset_wide[k] = p.piece_offset[k];
  for (int c = 0; c < PlanTables::kCopies; ++c)
    if (p.copy_n[c] > 0) std::memcpy(p.copy_dst[c], p.copy_src[c], p.copy_n[c] * sizeof(int32_t));
}

void unshard_index_cpu(int64_t* out, int64_t total, const int64_t* cu, int64_t nseq, const int64_t* cu_padded,
                       int64_t cp, int layout, int64_t total_local) {
  for (int64_t t = 0; t < total; ++t) out[t] = unshard_slot(layout, cu, nseq, cu_padded, cp, total_local, t);
}

}  // namespace packcuda::shard
