// Host block table of the mRoPE position kernels (framework-free; shared by the torch layer and C++ users).
#include <cstring>

#include "rope/mrope_pos.h"

namespace packcuda::rope {

MRopeBlockTable build_mrope_block_table(std::vector<int64_t> head, const MRopeGrid* images, int64_t n_images,
                                        const MRopeGrid* videos, int64_t n_videos, const float* secs, int64_t merge,
                                        const double* tokens_per_second, bool per_frame, bool text_after_max) {
  MRopeBlockTable b;
  const int64_t mm = merge * merge;
  std::vector<int64_t> rows[2];
  auto add = [&](int m, int64_t r, int64_t f, int64_t t, int64_t h, int64_t w, float interval) {
    const int64_t hm = h / merge, wm = w / merge;
    uint32_t bits;
    std::memcpy(&bits, &interval, sizeof(bits));
    const int64_t vals[kBlockCols] = {t * h * w / mm, t, hm, wm, static_cast<int64_t>(bits),
                                      block_advance(t, hm, wm, interval, text_after_max)};
    rows[m].insert(rows[m].end(), vals, vals + kBlockCols);
    b.row[m].push_back(r);
    b.frame[m].push_back(f);
  };
  for (int64_t i = 0; i < n_images; ++i) add(0, i, -1, images[i].t, images[i].h, images[i].w, 1.0f);
  for (int64_t i = 0; i < n_videos; ++i) {
    const MRopeGrid& g = videos[i];
    if (per_frame) {
      for (int64_t f = 0; f < g.t; ++f) add(1, i, f, 1, g.h, g.w, 1.0f);
    } else {
      float interval = 1.0f;  // one float32 multiply, as transformers computes it
      if (tokens_per_second) interval = static_cast<float>(*tokens_per_second) * (secs ? secs[i] : 1.0f);
      add(1, i, -1, g.t, g.h, g.w, interval);
    }
  }
  for (int m = 0; m < 2; ++m) b.n[m] = static_cast<int64_t>(b.row[m].size());
  b.head = static_cast<int64_t>(head.size());
  b.table = std::move(head);
  b.table.reserve(b.head + rows[0].size() + rows[1].size() + b.n[0] + b.n[1] + 2);
  b.table.insert(b.table.end(), rows[0].begin(), rows[0].end());
  b.table.insert(b.table.end(), rows[1].begin(), rows[1].end());
  for (int m = 0; m < 2; ++m) {
    int64_t acc = 0;
    b.table.push_back(0);
    for (int64_t k = 0; k < b.n[m]; ++k) {
      const int64_t* r = rows[m].data() + k * kBlockCols;
      acc += r[kLen] - r[kAdvance];
      b.table.push_back(acc);
    }
  }
  return b;
}

}  // namespace packcuda::rope
