// Torch layer of mRoPE position ids: schema, host checks of the grids, block table, dispatch.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/torch/checks.h"
#include "rope/mrope_pos.h"
#include "rope/mrope_pos_math.h"

namespace packcuda::th {
namespace {

using rope::kBlockCols;
using rope::MRopeTables;

constexpr const char* kOp = "mrope_position_ids";
const char* kModName[2] = {"image", "video"};
const char* kGridName[2] = {"image_grid_thw", "video_grid_thw"};

struct Grid {
  int64_t t, h, w;
};

std::vector<Grid> read_grid(const char* name, const Tensor& g, int64_t merge) {
  PC_ARG(g.is_cpu(), kOp, name, " must be host metadata (a list or CPU tensor), got a tensor on ", device_str(g));
  check_dtype(kOp, name, g, {ST::Int, ST::Long});
  if (g.numel() == 0) return {};
  check_dim(kOp, name, g, 2);
  PC_ARG(g.size(1) == 3, kOp, name, " must have shape [n, 3] (rows [t, h, w]), got ", shape_str(g));
  Tensor c = torch::stable::contiguous(torch::stable::to(g, ST::Long));
  const int64_t* p = c.const_data_ptr<int64_t>();
  std::vector<Grid> out(g.size(0));
  for (int64_t i = 0; i < g.size(0); ++i) {
    const Grid r{p[3 * i], p[3 * i + 1], p[3 * i + 2]};
    PC_ARG(r.t >= 1 && r.h >= 1 && r.w >= 1, kOp, name, "[", i, "] = [", r.t, ", ", r.h, ", ", r.w,
           "] must be positive");
    PC_ARG(r.h % merge == 0 && r.w % merge == 0, kOp, name, "[", i, "] = [", r.t, ", ", r.h, ", ", r.w,
           "]: h and w must be divisible by spatial_merge_size ", merge);
    out[i] = r;
  }
  return out;
}

// Host description of the blocks: the table uploaded to the kernels, and where each block comes from.
struct Blocks {
  std::vector<int64_t> table;  // [img rows][vid rows][px img (ni+1)][px vid (nv+1)]
  int64_t n[2] = {0, 0};
  std::vector<int64_t> row[2], frame[2];  // grid row and frame (per-frame videos) of each block
  std::vector<Grid> grid[2];
  int64_t offset_blocks(int m) const { return m == 0 ? 0 : n[0] * kBlockCols; }
  int64_t offset_px(int m) const { return (n[0] + n[1]) * kBlockCols + (m == 0 ? 0 : n[0] + 1); }
};

Blocks build_blocks(const Tensor& image_grid, const Tensor& video_grid, const Tensor& spg, int64_t merge,
                    std::optional<double> tps, bool per_frame, bool text_after_max) {
  Blocks b;
  b.grid[0] = read_grid(kGridName[0], image_grid, merge);
  b.grid[1] = read_grid(kGridName[1], video_grid, merge);
  const int64_t nv_rows = static_cast<int64_t>(b.grid[1].size());
  std::vector<float> secs;
  if (spg.numel() > 0) {
    PC_ARG(spg.is_cpu(), kOp, "second_per_grid_ts must be host metadata (a list or CPU tensor)");
    check_dtype(kOp, "second_per_grid_ts", spg, {ST::Float});
    PC_ARG(spg.numel() == nv_rows, kOp, "second_per_grid_ts has ", spg.numel(), " entries but video_grid_thw has ",
           nv_rows, " rows");
    PC_ARG(tps.has_value(), kOp, "second_per_grid_ts needs tokens_per_second");
    Tensor c = torch::stable::contiguous(spg);
    const float* p = c.const_data_ptr<float>();
    secs.assign(p, p + spg.numel());
  }
  const int64_t mm = merge * merge;
  std::vector<int64_t> rows[2];
  auto add = [&](int m, int64_t r, int64_t f, int64_t t, int64_t h, int64_t w, float interval) {
    const int64_t hm = h / merge, wm = w / merge;
    uint32_t bits;
    std::memcpy(&bits, &interval, sizeof(bits));
    const int64_t vals[kBlockCols] = {t * h * w / mm, t, hm, wm, static_cast<int64_t>(bits),
                                      rope::block_advance(t, hm, wm, interval, text_after_max)};
    rows[m].insert(rows[m].end(), vals, vals + kBlockCols);
    b.row[m].push_back(r);
    b.frame[m].push_back(f);
  };
  for (size_t i = 0; i < b.grid[0].size(); ++i) {
    const Grid& g = b.grid[0][i];
    add(0, i, -1, g.t, g.h, g.w, 1.0f);
  }
  for (int64_t i = 0; i < nv_rows; ++i) {
    const Grid& g = b.grid[1][i];
    if (per_frame) {
      for (int64_t f = 0; f < g.t; ++f) add(1, i, f, 1, g.h, g.w, 1.0f);
    } else {
      // Qwen2.5-VL: float32(tokens_per_second) * float32(second_per_grid_ts[i]), one float32 multiply.
      float interval = 1.0f;
      if (tps.has_value()) interval = static_cast<float>(*tps) * (secs.empty() ? 1.0f : secs[i]);
      add(1, i, -1, g.t, g.h, g.w, interval);
    }
  }
  for (int m = 0; m < 2; ++m) b.n[m] = static_cast<int64_t>(b.row[m].size());
  b.table = rows[0];
  b.table.insert(b.table.end(), rows[1].begin(), rows[1].end());
  for (int m = 0; m < 2; ++m) {
    int64_t acc = 0;
    b.table.push_back(0);
    for (int64_t k = 0; k < b.n[m]; ++k) {
      const int64_t* r = rows[m].data() + k * kBlockCols;
      acc += r[rope::kLen] - r[rope::kAdvance];
      b.table.push_back(acc);
    }
  }
  return b;
}

std::string describe(const Blocks& b, int m, int64_t k) {
  if (k >= b.n[m]) return detail::cat(kModName[m], " block ", k);
  const int64_t r = b.row[m][k];
  const Grid& g = b.grid[m][r];
  std::string s = detail::cat(kModName[m], " block ", k, " (", kGridName[m], "[", r, "] = [", g.t, ", ", g.h, ", ",
                              g.w, "]");
  if (b.frame[m][k] >= 0) s += detail::cat(", frame ", b.frame[m][k]);
  return s + ")";
}

template <typename I>
std::string error_message(int64_t key, const Blocks& b, const I* ids, int64_t total, const std::vector<int64_t>& cu,
                          int64_t image_id, int64_t video_id) {
  const int code = rope::mrope_key_code(key);
  const int m = rope::mrope_key_modality(key);
  const int64_t t = rope::mrope_key_token(key);
  const int64_t k = rope::mrope_key_block(key);
  const int64_t tok = m == 0 ? image_id : video_id;
  const int64_t seg = t < total ? static_cast<int64_t>(std::upper_bound(cu.begin(), cu.end(), t) - cu.begin()) - 1 : 0;
  const char* unit = (m == 1 && !b.frame[1].empty() && b.frame[1][0] >= 0) ? " (one per video frame)" : "";
  switch (code) {
    case rope::kRunLength: {
      int64_t e = t;
      while (e < cu[seg + 1] && static_cast<int64_t>(ids[e]) == tok) ++e;
      const int64_t* row = b.table.data() + b.offset_blocks(m) + k * kBlockCols;
      return detail::cat(describe(b, m, k), " needs ", row[rope::kLen], " ", kModName[m],
                         " tokens (t*h*w / spatial_merge_size**2) but the run of ", kModName[m],
                         " tokens starting at token ", t, " (segment ", seg, ") has ", e - t);
    }
    case rope::kCrossesSegment:
      return detail::cat(describe(b, m, k), " starting at token ", t, " crosses the end of segment ", seg,
                         " (token ", cu[seg + 1], "): a block must lie inside one segment");
    case rope::kExtraRun:
      return detail::cat("more ", kModName[m], " blocks than ", kGridName[m], " describes (", b.n[m], unit,
                         "): a run of ", kModName[m], " tokens starts at token ", t, " (segment ", seg, ")");
    case rope::kMissingRun:
      return detail::cat(kGridName[m], " describes ", b.n[m], " ", kModName[m], " blocks", unit,
                         " but input_ids has only ", k, " runs of ", kModName[m], " tokens");
    default:
      return detail::cat("invalid run structure (error key ", key, ")");
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor> mrope_position_ids(Tensor input_ids, Tensor cu_seqlens,
                                                              Tensor image_grid_thw, Tensor video_grid_thw,
                                                              Tensor second_per_grid_ts, int64_t image_token_id,
                                                              int64_t video_token_id, int64_t spatial_merge_size,
                                                              std::optional<double> tokens_per_second,
                                                              bool per_frame, bool text_after_max) {
  check_dim(kOp, "input_ids", input_ids, 1);
  check_dtype(kOp, "input_ids", input_ids, {ST::Int, ST::Long});
  PC_ARG(spatial_merge_size >= 1, kOp, "spatial_merge_size must be >= 1, got ", spatial_merge_size);
  PC_ARG(image_token_id != video_token_id, kOp, "image_token_id and video_token_id must differ, both are ",
         image_token_id);
  input_ids = torch::stable::contiguous(input_ids);
  const int64_t total = input_ids.numel();
  Segments seg = segments(kOp, "cu_seqlens", cu_seqlens, input_ids.device(), total);
  Blocks b = build_blocks(image_grid_thw, video_grid_thw, second_per_grid_ts, spatial_merge_size, tokens_per_second,
                          per_frame, text_after_max);
  if (total == 0)
    for (int m = 0; m < 2; ++m)
      PC_ARG(b.n[m] == 0, kOp, kGridName[m], " describes ", b.n[m], " ", kModName[m],
             " blocks but input_ids is empty");

  Tensor pos = torch::stable::new_empty(input_ids, {3, total}, ST::Long);
  Tensor text_pos = torch::stable::new_empty(input_ids, {total}, ST::Long);
  Tensor deltas = torch::stable::new_empty(input_ids, {seg.count}, ST::Long);
  const int esz = static_cast<int>(element_size(input_ids.scalar_type()));

  Tensor table = upload_i64(b.table, input_ids.device());
  MRopeTables tb;
  tb.cu = seg.ptr();
  tb.nseg = seg.count;
  const int64_t* tp = table.const_data_ptr<int64_t>();
  for (int m = 0; m < 2; ++m) {
    tb.blocks[m] = tp + b.offset_blocks(m);
    tb.px[m] = tp + b.offset_px(m);
    tb.nblocks[m] = b.n[m];
  }
  tb.token_id[0] = image_token_id;
  tb.token_id[1] = video_token_id;

  Tensor status;
  if (input_ids.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(input_ids);
      status = torch::stable::new_empty(input_ids, {1}, ST::Long);
      const size_t ws = rope::mrope_pos_cuda_workspace(total);
      Tensor work = torch::stable::new_empty(input_ids, {static_cast<int64_t>(ws)}, ST::Byte);
      rope::mrope_pos_cuda(pos.mutable_data_ptr<int64_t>(), text_pos.mutable_data_ptr<int64_t>(),
                           deltas.mutable_data_ptr<int64_t>(), status.mutable_data_ptr<int64_t>(),
                           work.mutable_data_ptr(), ws, input_ids.const_data_ptr(), esz, total, tb, cs.stream);
    });
  } else {
    std::vector<rope::MRopeScan> scratch(static_cast<size_t>(total));
    const int64_t key = rope::mrope_pos_cpu(pos.mutable_data_ptr<int64_t>(), text_pos.mutable_data_ptr<int64_t>(),
                                            deltas.mutable_data_ptr<int64_t>(), scratch.data(),
                                            input_ids.const_data_ptr(), esz, total, tb);
    if (key != rope::kMRopeOk) {
      std::string msg = esz == 4 ? error_message(key, b, input_ids.const_data_ptr<int32_t>(), total, seg.host,
                                                 image_token_id, video_token_id)
                                 : error_message(key, b, input_ids.const_data_ptr<int64_t>(), total, seg.host,
                                                 image_token_id, video_token_id);
      PC_ARG(false, kOp, msg);
    }
    status = upload_i64({rope::kMRopeOk}, input_ids.device());
  }
  return {pos, text_pos, deltas, status};
}

}  // namespace
}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def(
      "mrope_position_ids(Tensor input_ids, Tensor cu_seqlens, Tensor image_grid_thw, Tensor video_grid_thw, "
      "Tensor second_per_grid_ts, int image_token_id, int video_token_id, int spatial_merge_size=2, "
      "float? tokens_per_second=None, bool per_frame=False, bool text_after_max=False) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) {
  m.impl("mrope_position_ids", TORCH_BOX(&packcuda::th::mrope_position_ids));
}
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) {
  m.impl("mrope_position_ids", TORCH_BOX(&packcuda::th::mrope_position_ids));
}
#endif
