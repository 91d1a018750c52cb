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
           " before rounding up to a multiple of ", unit, ") does not fit int32 boundaries (at most ", kMaxPaddedTotal,
           ")");
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
  h.pad_size = bucket_pad_length(seq_total, unit);
  h.total_padded = seq_total + h.pad_size;
  if (h.pad_size > 0) {
    h.cu_padded.push_back(h.total_padded);
    h.max_seqlen_padded = std::max(h.max_seqlen_padded, h.pad_size);
  }
  const int64_t nseg = static_cast<int64_t>(h.cu_padded.size()) - 1;
  h.total_local = h.total_padded / cp;
  h.cu_local.resize(nseg + 1);
  // sized up front and written by index (push_back costs several times more on this per-batch host path)
  const int64_t np_max = max_pieces(layout, nseg);
  h.pieces.resize(np_max + 1);
  h.piece_offset.resize(np_max);
  h.piece_seq.resize(np_max);
  h.pieces[0] = 0;
  h.cu_local[0] = 0;
  int64_t np = 0;
  for (int64_t i = 0; i < nseg; ++i)
    np += write_segment_layout(layout, i, h.cu_padded[i], h.cu_padded[i + 1], cp, rank, h.total_local, np,
                               h.cu_local.data(), h.pieces.data(), h.piece_offset.data(), h.piece_seq.data());
  h.pieces.resize(np + 1);
  h.piece_offset.resize(np);
  h.piece_seq.resize(np);
  return h;
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

void static_build_cpu(const StaticBuild& b) {
  const int64_t n_in = static_num_seqs(b);
  const int64_t n = static_num_seqs_ok(b, n_in) ? n_in : 0;
  int64_t sum = 0, first_bad = b.cu[0] != 0 ? 0 : -1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = static_checked_length(b, i);
    if (p >= 0) sum = static_sum(sum, p);
    else if (first_bad < 0) first_bad = i + 1;
  }
  const StaticCheck c = static_check(b, n_in, sum, first_bad);
  static_write_head(b, c, first_bad);
  int64_t pb = 0, np = 0;
  for (int64_t i = 0; i < static_segments(b.max_seqs); ++i) {
    const int64_t pe = pb + static_segment_length(b, c, i);
    np += static_write_segment(b, c, i, pb, pe, np);
    pb = pe;
  }
  for (int64_t k = np; k < b.npieces; ++k) static_fill_piece(b, k);
}

void static_unshard_index_cpu(int64_t* out, int64_t capacity, const int32_t* cu, int64_t max_seqs,
                              const int32_t* cu_padded, int64_t cp, int layout, int64_t total_local) {
  for (int64_t t = 0; t < capacity; ++t)
    out[t] = static_unshard_slot(layout, cu, max_seqs, cu_padded, cp, total_local, t);
}

}  // namespace packcuda::shard
