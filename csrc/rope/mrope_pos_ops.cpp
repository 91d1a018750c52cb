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

using Grid = rope::MRopeGrid;

// Row i of an [n, 3] host tensor of dtype I, read through its strides (no copy, no conversion). Tensor
// accessors are calls across the stable ABI, so pointer and strides are read once per tensor.
template <typename I>
void read_rows(const Tensor& g, std::vector<Grid>& out) {
  const I* p = g.const_data_ptr<I>();
  const int64_t s0 = g.stride(0), s1 = g.stride(1);
  for (size_t i = 0; i < out.size(); ++i) {
    const I* r = p + static_cast<int64_t>(i) * s0;
    out[i] = Grid{static_cast<int64_t>(r[0]), static_cast<int64_t>(r[s1]), static_cast<int64_t>(r[2 * s1])};
  }
}

std::vector<Grid> read_grid(const char* name, const Tensor& g, int64_t merge) {
  PC_ARG(g.is_cpu(), kOp, name, " must be host metadata (a list or CPU tensor), got a tensor on ", device_str(g));
  check_dtype(kOp, name, g, {ST::Int, ST::Long});
  if (g.numel() == 0) return {};
  check_dim(kOp, name, g, 2);
  PC_ARG(g.size(1) == 3, kOp, name, " must have shape [n, 3] (rows [t, h, w]), got ", shape_str(g));
  std::vector<Grid> out(g.size(0));
  if (g.scalar_type() == ST::Int)
    read_rows<int32_t>(g, out);
  else
    read_rows<int64_t>(g, out);
  for (size_t i = 0; i < out.size(); ++i) {
    const Grid& r = out[i];
    PC_ARG(r.t >= 1 && r.h >= 1 && r.w >= 1, kOp, name, "[", i, "] = [", r.t, ", ", r.h, ", ", r.w,
           "] must be positive");
    PC_ARG(r.h % merge == 0 && r.w % merge == 0, kOp, name, "[", i, "] = [", r.t, ", ", r.h, ", ", r.w,
           "]: h and w must be divisible by spatial_merge_size ", merge);
  }
  return out;
}

// The block table (core) plus the grids it came from, for error messages.
struct Blocks : rope::MRopeBlockTable {
  std::vector<Grid> grid[2];
};

Blocks build_blocks(std::vector<int64_t> head, const Tensor& image_grid, const Tensor& video_grid,
                    const Tensor& spg, int64_t merge, std::optional<double> tps, bool per_frame,
                    bool text_after_max) {
  std::vector<Grid> grid[2] = {read_grid(kGridName[0], image_grid, merge), read_grid(kGridName[1], video_grid, merge)};
  const int64_t nv_rows = static_cast<int64_t>(grid[1].size());
  std::vector<float> secs;
  if (spg.numel() > 0) {
    PC_ARG(spg.is_cpu(), kOp, "second_per_grid_ts must be host metadata (a list or CPU tensor)");
    check_dtype(kOp, "second_per_grid_ts", spg, {ST::Float});
    PC_ARG(spg.numel() == nv_rows, kOp, "second_per_grid_ts has ", spg.numel(), " entries but video_grid_thw has ",
           nv_rows, " rows");
    PC_ARG(tps.has_value(), kOp, "second_per_grid_ts needs tokens_per_second");
    const Tensor c = spg.is_contiguous() ? spg : torch::stable::contiguous(spg);
    const float* p = c.const_data_ptr<float>();
    secs.assign(p, p + c.numel());
  }
  const double tps_v = tps.value_or(0.0);
  Blocks b;
  static_cast<rope::MRopeBlockTable&>(b) = rope::build_mrope_block_table(
      std::move(head), grid[0].data(), static_cast<int64_t>(grid[0].size()), grid[1].data(), nv_rows,
      secs.empty() ? nullptr : secs.data(), merge, tps.has_value() ? &tps_v : nullptr, per_frame, text_after_max);
  b.grid[0] = std::move(grid[0]);
  b.grid[1] = std::move(grid[1]);
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

// Host work per call, kept small because on CUDA it is most of the op's latency: the host metadata is read in
// place (no conversions), cu_seqlens and the block table go to the device in ONE pinned non-blocking copy, and the
// kernels take pointers into it. On CPU the kernels read the host vectors directly.
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
  if (!input_ids.is_contiguous()) input_ids = torch::stable::contiguous(input_ids);
  const int64_t total = input_ids.numel();
  Segments seg = segments(kOp, "cu_seqlens", cu_seqlens, input_ids.device(), total, /*upload=*/false);
  const bool cu_in_table = seg.on_host;
  Blocks b = build_blocks(cu_in_table ? seg.host : std::vector<int64_t>{}, image_grid_thw, video_grid_thw,
                          second_per_grid_ts, spatial_merge_size, tokens_per_second, per_frame, text_after_max);
  if (total == 0)
    for (int m = 0; m < 2; ++m)
      PC_ARG(b.n[m] == 0, kOp, kGridName[m], " describes ", b.n[m], " ", kModName[m],
             " blocks but input_ids is empty");

  Tensor pos = torch::stable::new_empty(input_ids, {3, total}, ST::Long);
  Tensor text_pos = torch::stable::new_empty(input_ids, {total}, ST::Long);
  Tensor deltas = torch::stable::new_empty(input_ids, {seg.count}, ST::Long);
  Tensor status = torch::stable::new_empty(input_ids, {1}, ST::Long);
  const int esz = static_cast<int>(element_size(input_ids.scalar_type()));

  auto tables = [&](const int64_t* tp) {
    return b.tables(tp, cu_in_table ? tp : seg.ptr(), seg.count, image_token_id, video_token_id);
  };

  if (input_ids.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(input_ids);
      const Tensor table = upload_i64(b.table, input_ids.device());  // the one host-to-device copy
      const MRopeTables tb = tables(table.const_data_ptr<int64_t>());
      const size_t ws = rope::mrope_pos_cuda_workspace(total);
      Tensor work = torch::stable::new_empty(input_ids, {static_cast<int64_t>(ws)}, ST::Byte);
      rope::mrope_pos_cuda(pos.mutable_data_ptr<int64_t>(), text_pos.mutable_data_ptr<int64_t>(),
                           deltas.mutable_data_ptr<int64_t>(), status.mutable_data_ptr<int64_t>(),
                           work.mutable_data_ptr(), ws, input_ids.const_data_ptr(), esz, total, tb, cs.stream);
    });
  } else {
    const MRopeTables tb = tables(b.table.data());
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
    *status.mutable_data_ptr<int64_t>() = rope::kMRopeOk;
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
