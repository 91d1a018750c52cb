// Index math of mRoPE position ids over a packed stream, shared by the CPU and CUDA kernels.
//
// Per segment (positions restart at 0 in each), with `cur` the next text position:
//   text token            -> (cur, cur, cur), then cur += 1
//   vision block at cur=s -> token (ti, hi, wi) of its merged grid (T', H', W'), t-major then h then w:
//                            (s + floor(ti * interval), s + hi, s + wi) with the product in float32
//                            then cur = s + advance, advance = max(H', W')               ("grid" rule)
//                                                  or  max(floor((T'-1)*interval), H'-1, W'-1) + 1  ("max" rule)
// So cur at a token = (offset in segment) - sum over earlier blocks of the segment of (len - advance). With the
// per-modality prefix sums of (len - advance) over the host-known block table, and an inclusive scan of
// (image runs started, video runs started, latest run start) over the tokens, every token's position is a
// closed formula: no sequential dependency left. Every run is checked against its block at its last token, which
// knows the run's first token (the latest start) and where the run ends: the checks need no random access either.
#pragma once
#include <cstdint>

#include "../common/hd.h"

namespace packcuda::rope {

constexpr int64_t kMRopeOk = INT64_MAX;
// Error codes inside a key (see mrope_error_key).
constexpr int kRunLength = 1;       // the run of tokens of a block is shorter or longer than its grid says
constexpr int kCrossesSegment = 2;  // the block runs to the end of its segment and would continue in the next
constexpr int kExtraRun = 3;        // more runs than blocks (grid rows)
constexpr int kMissingRun = 4;      // fewer runs than blocks

// Columns of a block-table row.
constexpr int kLen = 0, kT = 1, kH = 2, kW = 3, kInterval = 4, kAdvance = 5, kBlockCols = 6;

struct MRopeScan {
  int64_t counts;  // image runs started (low 32 bits) + video runs started (high 32 bits)
  int64_t start;   // index of the latest run start (-1: none)
};

struct MRopeScanOp {
  PC_HD MRopeScan operator()(const MRopeScan& a, const MRopeScan& b) const {
    return MRopeScan{a.counts + b.counts, a.start > b.start ? a.start : b.start};
  }
};

struct MRopeTables {
  const int64_t* cu = nullptr;       // [nseg + 1] segment boundaries
  int64_t nseg = 0;
  const int64_t* blocks[2] = {nullptr, nullptr};  // per modality (0 image, 1 video): [n, kBlockCols]
  const int64_t* px[2] = {nullptr, nullptr};      // per modality: [n + 1] prefix sums of (len - advance)
  int64_t nblocks[2] = {0, 0};
  int64_t token_id[2] = {-1, -1};    // image_token_id, video_token_id
  // Per-modality fields for a modality known only at run time: selects instead of indexing, so a kernel
  // parameter of this type stays in parameter space (a dynamic index would copy it to local memory).
  PC_HD const int64_t* blocks_of(int m) const { return m == 0 ? blocks[0] : blocks[1]; }
  PC_HD const int64_t* px_of(int m) const { return m == 0 ? px[0] : px[1]; }
  PC_HD int64_t nblocks_of(int m) const { return m == 0 ? nblocks[0] : nblocks[1]; }
};

// Error key: the smallest key over all errors is the one reported (the earliest in the stream).
PC_HD int64_t mrope_error_key(int64_t token, int code, int modality, int64_t block) {
  const int64_t b = block < 0xFFFFF ? block : 0xFFFFF;
  return (token << 24) | (static_cast<int64_t>(code) << 21) | (static_cast<int64_t>(modality) << 20) | b;
}
PC_HD int64_t mrope_key_token(int64_t key) { return key >> 24; }
PC_HD int mrope_key_code(int64_t key) { return static_cast<int>((key >> 21) & 7); }
PC_HD int mrope_key_modality(int64_t key) { return static_cast<int>((key >> 20) & 1); }
PC_HD int64_t mrope_key_block(int64_t key) { return key & 0xFFFFF; }

// floor(ti * interval) exactly as torch computes `(arange(T') * float32 interval).long()`: ti rounded to
// float32, one float32 multiply (round to nearest), truncation.
PC_HD int64_t temporal_index(int64_t ti, float interval) {
#if defined(__CUDA_ARCH__)
  return static_cast<int64_t>(__fmul_rn(__ll2float_rn(ti), interval));
#else
  const float p = static_cast<float>(ti) * interval;
  return static_cast<int64_t>(p);
#endif
}

PC_HD int64_t max3(int64_t a, int64_t b, int64_t c) {
  const int64_t m = a > b ? a : b;
  return m > c ? m : c;
}

// How far `cur` moves past a block of merged grid (t, h, w) that starts at cur.
PC_HD int64_t block_advance(int64_t t, int64_t h, int64_t w, float interval, bool text_after_max) {
  if (!text_after_max) return h > w ? h : w;
  return max3(temporal_index(t - 1, interval), h - 1, w - 1) + 1;
}

PC_HD float interval_of(const int64_t* row) { return bits_f32(static_cast<uint32_t>(row[kInterval])); }

PC_HD int token_type(int64_t id, const MRopeTables& tb) {
  return id == tb.token_id[0] ? 1 : (id == tb.token_id[1] ? 2 : 0);
}

PC_HD int64_t scan_count(const MRopeScan& s, int modality) {
  return modality == 0 ? (s.counts & 0xFFFFFFFFll) : (s.counts >> 32);
}

PC_HD int64_t clamp_i64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Sum of (len - advance) over the blocks counted in s (counts clamped to the table, for bad input).
PC_HD int64_t excess_before(const MRopeScan& s, const MRopeTables& tb) {
  return tb.px[0][clamp_i64(scan_count(s, 0), 0, tb.nblocks[0])] +
         tb.px[1][clamp_i64(scan_count(s, 1), 0, tb.nblocks[1])];
}

// Token t is a run start when it is a vision token (type ty != 0) whose previous token in its segment has another
// type (prev_ty: type of token t-1, ignored at a segment start).
PC_HD bool mrope_is_run_start(int ty, int prev_ty, bool segment_start) {
  return ty != 0 && (segment_start || prev_ty != ty);
}

// Check of one run of modality m (0 image, 1 video): tokens [b0, r) of the segment that ends at `end`, block index
// k (runs of modality m before it), next_ty = type of token r (0 when r == total). Checked at the run's last token,
// with the key of its first token: kMRopeOk or the run's error key.
PC_HD int64_t mrope_check_run(int m, int64_t b0, int64_t r, int64_t k, int64_t end, int64_t total, int next_ty,
                              const MRopeTables& tb) {
  if (k >= tb.nblocks_of(m)) return mrope_error_key(b0, kExtraRun, m, k);
  const int64_t e = b0 + tb.blocks_of(m)[k * kBlockCols + kLen];
  if (r == e) return kMRopeOk;
  // The run reaches the end of its segment, the block needs more, and the next segment goes on with the same
  // token type: the block was cut by the segment boundary.
  if (e > end && r == end && end < total && next_ty == m + 1) return mrope_error_key(b0, kCrossesSegment, m, k);
  return mrope_error_key(b0, kRunLength, m, k);
}

// Fewer runs than blocks: checked once with the scan of the last token.
PC_HD int64_t mrope_check_counts(const MRopeScan& last, const MRopeTables& tb, int64_t total) {
  for (int m = 0; m < 2; ++m)
    if (scan_count(last, m) < tb.nblocks_of(m)) return mrope_error_key(total, kMissingRun, m, scan_count(last, m));
  return kMRopeOk;
}

// Positions (t, h, w) of token t of type ty in the segment that starts at token a. sv: the runs started up to t
// (inclusive counts) and the latest run start <= t; e0 = excess_before(runs started before the segment).
// Counts beyond the block table (bad input) are clamped: the positions stay in range.
PC_HD void mrope_positions(int64_t p[3], int ty, int64_t t, int64_t a, const MRopeScan& sv, int64_t e0,
                           const MRopeTables& tb) {
  if (ty == 0 || tb.nblocks_of(ty - 1) == 0 || sv.start < a) {
    const int64_t cur = (t - a) - (excess_before(sv, tb) - e0);
    p[0] = p[1] = p[2] = cur;
    return;
  }
  const int m = ty - 1;
  const int64_t k = clamp_i64(scan_count(sv, m) - 1, 0, tb.nblocks_of(m) - 1);
  const int64_t b0 = sv.start;
  const int64_t eb = tb.px_of(m)[k] + tb.px_of(1 - m)[clamp_i64(scan_count(sv, 1 - m), 0, tb.nblocks_of(1 - m))];
  const int64_t s = (b0 - a) - (eb - e0);
  const int64_t* row = tb.blocks_of(m) + k * kBlockCols;
  const int64_t h = row[kH], w = row[kW];
  const int64_t off = t - b0;
  const int64_t ti = div_nonneg(off, h * w);
  const int64_t r = off - ti * (h * w);
  const int64_t hi = div_nonneg(r, w);
  p[0] = s + temporal_index(ti, interval_of(row));
  p[1] = s + hi;
  p[2] = s + (r - hi * w);
}

// deltas[seg] candidate of the last token of a run (text or vision) of a segment of length seg_len: the run holds
// the maximum position reached so far in the segment.
PC_HD int64_t mrope_delta(const int64_t p[3], int64_t seg_len) { return max3(p[0], p[1], p[2]) + 1 - seg_len; }

}  // namespace packcuda::rope
