// Host block table of the mRoPE position kernels (framework-free; shared by the torch layer and C++ users).

#include "mrope/mrope_pos.h"

namespace packcuda::rope {

MRopeTableLayout mrope_table_layout(int64_t head, int64_t n_images, const MRopeGrid* videos, int64_t n_videos,
                                    bool per_frame) {
  MRopeTableLayout L;
  L.head = head;
  L.n[0] = n_images;
  L.n[1] = n_videos;
  if (per_frame) {
    L.n[1] = 0;
    for (int64_t i = 0; i < n_videos; ++i) L.n[1] += videos[i].t;
  }
  return L;
}

void fill_mrope_block_table(int64_t* out, const MRopeTableLayout& L, const MRopeGrid* images, const MRopeGrid* videos,
                            int64_t n_videos, const float* secs, int64_t merge, const double* tokens_per_second,
                            bool per_frame, bool text_after_max) {
  const MergeDiv md(merge);
  for (int m = 0; m < 2; ++m) {
    int64_t* row = out + L.offset_blocks(m);
    int64_t* px = out + L.offset_px(m);
    int64_t acc = 0;
    *px++ = 0;
    auto add = [&](int64_t t, int64_t h, int64_t w, float interval) {
      const int64_t hm = md.div(h), wm = md.div(w);
      row[kLen] = t * hm * wm;  // = t*h*w / merge**2 (h and w are multiples of merge)
      row[kT] = t;
      row[kH] = hm;
      row[kW] = wm;
      row[kInterval] = static_cast<int64_t>(f32_bits(interval));  // read back by interval_of
      row[kAdvance] = block_advance(t, hm, wm, interval, text_after_max);
      acc += row[kLen] - row[kAdvance];
      *px++ = acc;
      row += kBlockCols;
    };
    if (m == 0) {
      for (int64_t i = 0; i < L.n[0]; ++i) add(images[i].t, images[i].h, images[i].w, 1.0f);
      continue;
    }
    for (int64_t i = 0; i < n_videos; ++i) {
      const MRopeGrid& g = videos[i];
      if (per_frame) {
        for (int64_t f = 0; f < g.t; ++f) add(1, g.h, g.w, 1.0f);
      } else {
        add(g.t, g.h, g.w, mrope_video_interval(tokens_per_second, secs, i));
      }
    }
  }
}

MRopeBlockTable build_mrope_block_table(std::vector<int64_t> head, const MRopeGrid* images, int64_t n_images,
                                        const MRopeGrid* videos, int64_t n_videos, const float* secs, int64_t merge,
                                        const double* tokens_per_second, bool per_frame, bool text_after_max) {
  MRopeBlockTable b;
  static_cast<MRopeTableLayout&>(b) =
      mrope_table_layout(static_cast<int64_t>(head.size()), n_images, videos, n_videos, per_frame);
  b.table = std::move(head);
  b.table.resize(b.size());
  fill_mrope_block_table(b.table.data(), b, images, videos, n_videos, secs, merge, tokens_per_second, per_frame,
                         text_after_max);
  for (int64_t i = 0; i < n_images; ++i) {
    b.row[0].push_back(i);
    b.frame[0].push_back(-1);
  }
  for (int64_t i = 0; i < n_videos; ++i)
    for (int64_t f = 0; f < (per_frame ? videos[i].t : 1); ++f) {
      b.row[1].push_back(i);
      b.frame[1].push_back(per_frame ? f : -1);
    }
  return b;
}

}  // namespace packcuda::rope
