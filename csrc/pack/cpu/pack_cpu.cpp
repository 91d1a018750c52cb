#include <cstring>

#include "pack/pack.h"
#include "pack/pack_math.h"

namespace packcuda::pack {

void gather_rows_cpu(void* out, const void* src, const int64_t* index, int64_t n_out, int64_t row_bytes,
                     uint64_t fill_elem, int elem_size, int64_t lead, int64_t src_lead_bytes) {
  const Fill16 f = replicate_fill(fill_elem, elem_size);
  const unsigned char* fb = reinterpret_cast<const unsigned char*>(&f);
  for (int64_t l = 0; l < lead; ++l) {
    auto* o = static_cast<unsigned char*>(out) + l * n_out * row_bytes;
    const auto* s = static_cast<const unsigned char*>(src) + l * src_lead_bytes;
    for (int64_t i = 0; i < n_out; ++i) {
      unsigned char* dst = o + i * row_bytes;
      const int64_t r = index[i];
      if (r >= 0) {
        std::memcpy(dst, s + r * row_bytes, row_bytes);
      } else if (f.lo == 0) {
        std::memset(dst, 0, row_bytes);
      } else {
        for (int64_t b = 0; b < row_bytes; b += elem_size) std::memcpy(dst + b, fb, elem_size);
      }
    }
  }
}

void scatter_rows_cpu(void* out, int64_t n_out, const void* src, const int64_t* index, int64_t n_src, int64_t row_bytes,
                      int64_t lead, int64_t src_lead_bytes) {
  if (n_out > 0 && lead > 0) std::memset(out, 0, lead * n_out * row_bytes);
  for (int64_t l = 0; l < lead; ++l) {
    auto* o = static_cast<unsigned char*>(out) + l * n_out * row_bytes;
    const auto* s = static_cast<const unsigned char*>(src) + l * src_lead_bytes;
    for (int64_t i = 0; i < n_src; ++i)
      if (index[i] >= 0) std::memcpy(o + index[i] * row_bytes, s + i * row_bytes, row_bytes);
  }
}

void invert_index_cpu(int64_t* inv, int64_t n_inv, const int64_t* index, int64_t n_index) {
  for (int64_t i = 0; i < n_inv; ++i) inv[i] = -1;
  for (int64_t i = 0; i < n_index; ++i)
    if (index[i] >= 0) inv[index[i]] = i;
}

void segment_positions_cpu(int64_t* out, const int64_t* cu, int64_t nseg, int64_t total) {
  for (int64_t t = 0; t < total; ++t) out[t] = position_in_segment(cu, nseg, t);
}

template <typename T>
static void next_token_labels_impl(T* out, const T* ids, const int64_t* cu, int64_t nseg, int64_t total,
                                   int64_t ignore_index) {
  for (int64_t t = 0; t < total; ++t) {
    const int64_t src = next_token_source(cu, nseg, t);
    out[t] = src >= 0 ? ids[src] : static_cast<T>(ignore_index);
  }
}

void next_token_labels_cpu(void* out, const void* ids, int elem_size, const int64_t* cu, int64_t nseg, int64_t total,
                           int64_t ignore_index) {
  if (elem_size == 4)
    next_token_labels_impl(static_cast<int32_t*>(out), static_cast<const int32_t*>(ids), cu, nseg, total, ignore_index);
  else
    next_token_labels_impl(static_cast<int64_t*>(out), static_cast<const int64_t*>(ids), cu, nseg, total, ignore_index);
}

void right_pad_indices_cpu(int64_t* out, const int64_t* cu, int64_t nseg, int64_t seqlen, int64_t total) {
  for (int64_t t = 0; t < total; ++t) out[t] = right_pad_flat_index(cu, nseg, seqlen, t);
}

void mask_indices_cpu(int64_t* out, const uint8_t* mask, int64_t rows, int64_t cols, const int64_t* cu) {
  for (int64_t r = 0; r < rows; ++r) {
    int64_t k = cu[r];
    for (int64_t c = 0; c < cols; ++c)
      if (mask[r * cols + c]) out[k++] = r * cols + c;
  }
}

}  // namespace packcuda::pack
