// Torch layer of mRoPE position ids: schema, host checks of the grids, block table, dispatch.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/checked.h"
#include "common/torch/checks.h"
#include "mrope/mrope_pos.h"
#include "mrope/mrope_pos_math.h"

namespace packcuda::th {
namespace {

using rope::kBlockCols;
using rope::MRopeTables;

constexpr const char* kOp = "mrope_position_ids";
const char* kModName[2] = {"image", "video"};
const char* kGridName[2] = {"image_grid_thw", "video_grid_thw"};

using Grid = rope::MRopeGrid;

// Rows of an [n, 3] host tensor of dtype I appended to `out`, read through its strides (no copy, no conversion).
// Tensor accessors are calls across the stable ABI, so pointer and strides are read once per tensor.
template <typename I>
void read_rows(const Tensor& g, int64_t n, std::vector<Grid>& out) {
  const I* p = g.const_data_ptr<I>();
  const int64_t s0 = g.stride(0), s1 = g.stride(1);
  for (int64_t i = 0; i < n; ++i) {
    const I* r = p + i * s0;
    out.push_back(Grid{static_cast<int64_t>(r[0]), static_cast<int64_t>(r[s1]), static_cast<int64_t>(r[2 * s1])});
  }
}

// Appends the checked rows of a grid argument to `out`; returns how many.
int64_t read_grid(const char* name, const Tensor& g, int64_t merge, std::vector<Grid>& out) {
  PC_ARG(g.is_cpu(), kOp, name, " must be host metadata (a list or CPU tensor), got a tensor on ", device_str(g));
  const ST dt = g.scalar_type();
  if (dt != ST::Int && dt != ST::Long) check_dtype(kOp, name, g, {ST::Int, ST::Long});
  if (g.numel() == 0) return 0;
  check_dim(kOp, name, g, 2);
  PC_ARG(g.size(1) == 3, kOp, name, " must have shape [n, 3] (rows [t, h, w]), got ", shape_str(g));
  const int64_t n = g.size(0);
  const size_t first = out.size();
  if (dt == ST::Int) read_rows<int32_t>(g, n, out);
  else read_rows<int64_t>(g, n, out);
  const rope::MergeDiv md(merge);
  for (int64_t i = 0; i < n; ++i) {
    const Grid& r = out[first + i];
    PC_ARG(r.t >= 1 && r.h >= 1 && r.w >= 1, kOp, name, "[", i, "] = [", r.t, ", ", r.h, ", ", r.w,
           "] must be positive");
    PC_ARG(md.divides(r.h) && md.divides(r.w), kOp, name, "[", i, "] = [", r.t, ", ", r.h, ", ", r.w,
           "]: h and w must be divisible by spatial_merge_size ", merge);
  }
  return n;
}

// The checked host metadata of one call: grids (image rows, then video rows) and the video seconds.
struct Grids {
  std::vector<Grid> rows;
  int64_t n_images = 0, n_videos = 0;
  Tensor secs_tensor;  // keeps `secs` alive
  const float* secs = nullptr;
  const Grid* images() const { return rows.data(); }
  const Grid* videos() const { return rows.data() + n_images; }
};

Grids read_grids(const Tensor& image_grid, const Tensor& video_grid, const Tensor& spg, int64_t merge,
                 const std::optional<double>& tps) {
  Grids g;
  g.rows.reserve(static_cast<size_t>(image_grid.numel() / 3 + video_grid.numel() / 3));
  g.n_images = read_grid(kGridName[0], image_grid, merge, g.rows);
  g.n_videos = read_grid(kGridName[1], video_grid, merge, g.rows);
  if (tps.has_value())
    PC_ARG(std::isfinite(*tps) && *tps >= 0 && *tps <= FLT_MAX, kOp,
           "tokens_per_second must be finite, >= 0 and within float32, got ", *tps);
  PC_ARG(spg.is_cpu(), kOp, "second_per_grid_ts must be host metadata (a list or CPU tensor), got a tensor on ",
         device_str(spg));
  if (spg.numel() > 0) {
    check_dtype(kOp, "second_per_grid_ts", spg, {ST::Float});
    check_dim(kOp, "second_per_grid_ts", spg, 1);
    PC_ARG(spg.numel() == g.n_videos, kOp, "second_per_grid_ts has ", spg.numel(), " entries but video_grid_thw has ",
           g.n_videos, " rows");
    PC_ARG(tps.has_value(), kOp, "second_per_grid_ts needs tokens_per_second");
    g.secs_tensor = spg.is_contiguous() ? spg : torch::stable::contiguous(spg);
    g.secs = g.secs_tensor.const_data_ptr<float>();
    for (int64_t i = 0; i < g.n_videos; ++i)
      PC_ARG(std::isfinite(g.secs[i]) && g.secs[i] >= 0, kOp, "second_per_grid_ts[", i,
             "] must be finite and >= 0, got ", g.secs[i]);
  }
  return g;
}

// The sizes the grids imply, in checked int64 arithmetic, before anything is sized or written from them: every
// block's token count t*h*w / spatial_merge_size**2 and their sum, which cannot exceed the number of tokens (every
// block is a run of its own tokens; returned), and a bound of every position. In a segment, text resumes at most
// `advance` past a block start and a block's positions reach s + max(floor((T'-1) * interval), H'-1, W'-1), so
// total + sum(len) + sum(max(floor((T'-1) * interval), H', W') + 1) bounds every position and every prefix sum of
// the block table; twice it must fit int64 (the kernels subtract such sums), so no value wraps.
int64_t check_grid_sizes(const Grids& g, int64_t merge, const double* tps, bool per_frame, int64_t total) {
  namespace ck = packcuda::checked;
  const rope::MergeDiv md(merge);
  const char* kTokens = "the number of vision tokens of image_grid_thw and video_grid_thw";
  const char* kBound = "the largest mRoPE position of image_grid_thw and video_grid_thw";
  const char* kCount[2] = {"an image_grid_thw row's token count (t*h*w / spatial_merge_size**2)",
                           "a video_grid_thw row's token count (t*h*w / spatial_merge_size**2)"};
  int64_t tokens = 0, bound = total;
  for (int m = 0; m < 2; ++m) {
    const Grid* rows = m == 0 ? g.images() : g.videos();
    const int64_t n = m == 0 ? g.n_images : g.n_videos;
    for (int64_t i = 0; i < n; ++i) {
      const Grid& r = rows[i];
      const int64_t hm = md.div(r.h), wm = md.div(r.w);
      const int64_t len = ck::mul(kOp, kCount[m], r.t, ck::mul(kOp, kCount[m], hm, wm));
      tokens = ck::add(kOp, kTokens, tokens, len);
      int64_t adv;
      if (m == 1 && per_frame) {  // r.t blocks [1, h, w]
        adv = ck::mul(kOp, kBound, r.t, ck::add(kOp, kBound, std::max(hm, wm), 1));
      } else {
        const float interval = m == 0 ? 1.0f : rope::mrope_video_interval(tps, g.secs, i);
        PC_ARG(std::isfinite(interval), kOp, kGridName[m], "[", i, "]: the time interval tokens_per_second * ",
               "second_per_grid_ts[", i, "] overflows float32");
        const float p = static_cast<float>(r.t - 1) * interval;  // as rope::temporal_index computes it
        PC_ARG(std::isfinite(p) && p < 9.2233720368547758e18f, kOp, kGridName[m], "[", i, "] = [", r.t, ", ", r.h, ", ",
               r.w, "]: its temporal positions (t-1) * ", interval,
               " (tokens_per_second * second_per_grid_ts) overflow int64");
        adv = ck::add(kOp, kBound, rope::max3(rope::temporal_index(r.t - 1, interval), hm, wm), 1);
      }
      bound = ck::add(kOp, kBound, ck::add(kOp, kBound, bound, len), adv);
    }
  }
  ck::mul(kOp, kBound, bound, 2);
  return tokens;
}

// Error messages are rare: the table with its block -> grid row map is rebuilt only then.
std::string describe(const rope::MRopeBlockTable& b, const Grids& g, int m, int64_t k) {
  if (k >= b.n[m]) return detail::cat(kModName[m], " block ", k);
  const int64_t r = b.row[m][k];
  const Grid& gr = (m == 0 ? g.images() : g.videos())[r];
  std::string s =
      detail::cat(kModName[m], " block ", k, " (", kGridName[m], "[", r, "] = [", gr.t, ", ", gr.h, ", ", gr.w, "]");
  if (b.frame[m][k] >= 0) s += detail::cat(", frame ", b.frame[m][k]);
  return s + ")";
}

template <typename I>
std::string error_message(int64_t key, const Grids& g, int64_t merge, const std::optional<double>& tps, bool per_frame,
                          bool text_after_max, const I* ids, int64_t total, const std::vector<int64_t>& cu,
                          int64_t image_id, int64_t video_id) {
  const double tps_v = tps.value_or(0.0);
  const rope::MRopeBlockTable b =
      rope::build_mrope_block_table({}, g.images(), g.n_images, g.videos(), g.n_videos, g.secs, merge,
                                    tps.has_value() ? &tps_v : nullptr, per_frame, text_after_max);
  const int code = rope::mrope_key_code(key);
  const int m = rope::mrope_key_modality(key);
  const int64_t t = rope::mrope_key_token(key);
  const int64_t k = rope::mrope_key_block(key);
  const int64_t tok = m == 0 ? image_id : video_id;
  const int64_t seg = t < total ? static_cast<int64_t>(std::upper_bound(cu.begin(), cu.end(), t) - cu.begin()) - 1 : 0;
  const char* unit = (m == 1 && per_frame) ? " (one per video frame)" : "";
  switch (code) {
    case rope::kRunLength: {
      int64_t e = t;
      while (e < cu[seg + 1] && static_cast<int64_t>(ids[e]) == tok) ++e;
      const int64_t* row = b.table.data() + b.offset_blocks(m) + k * kBlockCols;
      return detail::cat(describe(b, g, m, k), " needs ", row[rope::kLen], " ", kModName[m],
                         " tokens (t*h*w / spatial_merge_size**2) but the run of ", kModName[m],
                         " tokens starting at token ", t, " (segment ", seg, ") has ", e - t);
    }
    case rope::kCrossesSegment:
      return detail::cat(describe(b, g, m, k), " starting at token ", t, " crosses the end of segment ", seg,
                         " (token ", cu[seg + 1], "): a block must lie inside one segment");
    case rope::kExtraRun:
      return detail::cat("more ", kModName[m], " blocks than ", kGridName[m], " describes (", b.n[m], unit,
                         "): a run of ", kModName[m], " tokens starts at token ", t, " (segment ", seg, ")");
    case rope::kMissingRun:
      return detail::cat(kGridName[m], " describes ", b.n[m], " ", kModName[m], " blocks", unit,
                         " but input_ids has only ", k, " runs of ", kModName[m], " tokens");
    default: return detail::cat("invalid run structure (error key ", key, ")");
  }
}

// Host work per call, kept small because on CUDA it is most of the op's latency: the host metadata is read in
// place (no conversions), the block table is written straight into the buffer that goes to the device (pinned:
// cu_seqlens and the table travel in ONE non-blocking copy) and every allocation goes through the C shim's
// empty_strided (new_tensor). On CPU the kernels read a host vector.
std::tuple<Tensor, Tensor, Tensor, Tensor> mrope_position_ids(Tensor input_ids, Tensor cu_seqlens,
                                                              Tensor image_grid_thw, Tensor video_grid_thw,
                                                              Tensor second_per_grid_ts, int64_t image_token_id,
                                                              int64_t video_token_id, int64_t spatial_merge_size,
                                                              std::optional<double> tokens_per_second, bool per_frame,
                                                              bool text_after_max) {
  if (input_ids.dim() != 1) check_dim(kOp, "input_ids", input_ids, 1);
  const ST id_type = input_ids.scalar_type();
  if (id_type != ST::Int && id_type != ST::Long) check_dtype(kOp, "input_ids", input_ids, {ST::Int, ST::Long});
  PC_ARG(spatial_merge_size >= 1, kOp, "spatial_merge_size must be >= 1, got ", spatial_merge_size);
  PC_ARG(image_token_id != video_token_id, kOp, "image_token_id and video_token_id must differ, both are ",
         image_token_id);
  input_ids = dense(input_ids);
  const int64_t total = input_ids.numel();
  const torch::stable::Device device = input_ids.device();
  const Segments seg = segments(kOp, "cu_seqlens", cu_seqlens, device, total, /*upload=*/false);
  const bool cu_in_table = seg.on_host;
  const Grids g = read_grids(image_grid_thw, video_grid_thw, second_per_grid_ts, spatial_merge_size, tokens_per_second);
  const double tps_v = tokens_per_second.value_or(0.0);
  const double* tps = tokens_per_second.has_value() ? &tps_v : nullptr;
  const int64_t vision_tokens = check_grid_sizes(g, spatial_merge_size, tps, per_frame, total);
  const int64_t head = cu_in_table ? static_cast<int64_t>(seg.host.size()) : 0;
  const rope::MRopeTableLayout L = rope::mrope_table_layout(head, g.n_images, g.videos(), g.n_videos, per_frame);
  if (total == 0)
    for (int m = 0; m < 2; ++m)
      PC_ARG(L.n[m] == 0, kOp, kGridName[m], " describes ", L.n[m], " ", kModName[m], " blocks but input_ids is empty");
  PC_ARG(vision_tokens <= total, kOp, "image_grid_thw and video_grid_thw describe ", vision_tokens,
         " vision tokens (t*h*w / spatial_merge_size**2 per row) but input_ids has only ", total, " tokens");
  // The table: [cu_seqlens (host metadata only)] [block rows] [prefix sums].
  auto fill = [&](int64_t* out) {
    if (head) std::memcpy(out, seg.host.data(), static_cast<size_t>(head) * sizeof(int64_t));
    rope::fill_mrope_block_table(out, L, g.images(), g.videos(), g.n_videos, g.secs, spatial_merge_size, tps, per_frame,
                                 text_after_max);
  };

  Tensor pos = new_tensor({3, total}, ST::Long, device);
  Tensor text_pos = new_tensor({total}, ST::Long, device);
  Tensor deltas = new_tensor({seg.count}, ST::Long, device);
  Tensor status = new_tensor({1}, ST::Long, device);
  const int esz = id_type == ST::Int ? 4 : 8;

  run_kernel(
      input_ids,
      [&] {
        std::vector<int64_t> table(static_cast<size_t>(L.size()));
        fill(table.data());
        const rope::MRopeTables tb = L.tables(table.data(), table.data(), seg.count, image_token_id, video_token_id);
        const int64_t key =
            rope::mrope_pos_cpu(pos.mutable_data_ptr<int64_t>(), text_pos.mutable_data_ptr<int64_t>(),
                                deltas.mutable_data_ptr<int64_t>(), input_ids.const_data_ptr(), esz, total, tb);
        if (key != rope::kMRopeOk) {
          const void* ids = input_ids.const_data_ptr();
          std::string msg =
              esz == 4
                  ? error_message(key, g, spatial_merge_size, tokens_per_second, per_frame, text_after_max,
                                  static_cast<const int32_t*>(ids), total, seg.host, image_token_id, video_token_id)
                  : error_message(key, g, spatial_merge_size, tokens_per_second, per_frame, text_after_max,
                                  static_cast<const int64_t*>(ids), total, seg.host, image_token_id, video_token_id);
          PC_ARG(false, kOp, msg);
        }
        *status.mutable_data_ptr<int64_t>() = rope::kMRopeOk;
      },
      [&](auto stream) {
        // [table][arrival counter = 0]: the kernels' counter travels with the table (no memset).
        Tensor staging = new_tensor({L.size() + 1}, ST::Long, torch::stable::Device(torch::headeronly::DeviceType::CPU),
                                    /*pinned=*/true);
        int64_t* host = staging.mutable_data_ptr<int64_t>();
        fill(host);
        host[L.size()] = 0;
        Tensor table = new_tensor({L.size() + 1}, ST::Long, device);
        copy_into(table, staging, /*non_blocking=*/true);  // the one host-to-device copy (no sync)
        int64_t* tp = table.mutable_data_ptr<int64_t>();
        const rope::MRopeTables tb =
            L.tables(tp, cu_in_table ? tp : seg.ptr(), seg.count, image_token_id, video_token_id);
        const size_t ws = rope::mrope_pos_cuda_workspace(total, seg.count);
        Tensor work = new_tensor({static_cast<int64_t>(ws)}, ST::Byte, device);
        rope::mrope_pos_cuda(pos.mutable_data_ptr<int64_t>(), text_pos.mutable_data_ptr<int64_t>(),
                             deltas.mutable_data_ptr<int64_t>(), status.mutable_data_ptr<int64_t>(),
                             work.mutable_data_ptr(), ws, tp + L.size(), input_ids.const_data_ptr(), esz, total, tb,
                             stream);
      });
  return {pos, text_pos, deltas, status};
}

// The token a status word of mrope_position_ids points at (the first token of the earliest bad run), or -1 for
// a good one: the status layout (mrope_error_key) is read here only, Python asks this op.
int64_t mrope_status_token(int64_t status) {
  PC_ARG(status >= 0, "mrope_status_token", "status must be a status word of mrope_position_ids (>= 0), got ", status);
  return status == rope::kMRopeOk ? -1 : rope::mrope_key_token(status);
}

}  // namespace
}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def("mrope_status_token(int status) -> int");
  m.def(
      "mrope_position_ids(Tensor input_ids, Tensor cu_seqlens, Tensor image_grid_thw, Tensor video_grid_thw, "
      "Tensor second_per_grid_ts, int image_token_id, int video_token_id, int spatial_merge_size=2, "
      "float? tokens_per_second=None, bool per_frame=False, bool text_after_max=False) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(packcuda, CompositeExplicitAutograd, m) { PC_IMPL(m, "mrope_status_token", &packcuda::th::mrope_status_token); }

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) { PC_IMPL(m, "mrope_position_ids", &packcuda::th::mrope_position_ids); }
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) { PC_IMPL(m, "mrope_position_ids", &packcuda::th::mrope_position_ids); }
#endif
