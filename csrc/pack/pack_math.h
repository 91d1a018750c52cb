// Index math of the packing ops, shared by the CPU and CUDA kernels.
#pragma once
#include "../common/hd.h"

namespace packcuda::pack {

// Position of token t inside its segment.
PC_HD int64_t position_in_segment(const int64_t* cu, int64_t nseg, int64_t t) {
  return t - cu[find_segment(cu, nseg, t)];
}

// Source row of the next-token label of token t, or -1 when t is the last token of its segment.
PC_HD int64_t next_token_source(const int64_t* cu, int64_t nseg, int64_t t) {
  const int64_t s = find_segment(cu, nseg, t);
  return (t + 1 < cu[s + 1]) ? t + 1 : -1;
}

// Flat index in a right-padded [nseg, seqlen] batch of packed token t.
PC_HD int64_t right_pad_flat_index(const int64_t* cu, int64_t nseg, int64_t seqlen, int64_t t) {
  const int64_t s = find_segment(cu, nseg, t);
  return s * seqlen + (t - cu[s]);
}

// A fill element replicated over 16 bytes (fill_elem holds elem_size bytes).
struct Fill16 {
  uint64_t lo, hi;
};
inline Fill16 replicate_fill(uint64_t fill_elem, int elem_size) {
  uint64_t v = fill_elem;
  if (elem_size == 1) v &= 0xffull, v |= v << 8, v |= v << 16, v |= v << 32;
  else if (elem_size == 2) v &= 0xffffull, v |= v << 16, v |= v << 32;
  else if (elem_size == 4) v &= 0xffffffffull, v |= v << 32;
  return Fill16{v, v};
}

}  // namespace packcuda::pack
