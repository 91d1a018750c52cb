// Torch layer of the layout bridge: the host schedule of a plan pair (relayout_schedule) and the static move's
// tables of a static plan pair (relayout_static_tables).
#include <string>
#include <tuple>

#include "common/torch/checks.h"
#include "exchange/exchange_ops.h"
#include "relayout/relayout.h"
#include "shard/shard.h"
#include "shard/torch/shard_args.h"

namespace packcuda::th {
namespace {

using torch::stable::Device;

// The schedule of rank cp_rank for the move of its rows from the plan (src_layout, src_align, src_bucket) to the
// plan (dst_layout, dst_align, dst_bucket) of the same cu_seqlens (parameters as shard_plan): both layouts must
// index one padded stream (the same cu_seqlens_padded). The outputs of schedule_tensors.
std::vector<Tensor> relayout_schedule(Tensor cu_seqlens, int64_t cp_size, int64_t cp_rank, std::string src_layout_str,
                                      int64_t src_align, std::optional<int64_t> src_bucket, std::string dst_layout_str,
                                      int64_t dst_align, std::optional<int64_t> dst_bucket) {
  const char* op = "relayout_schedule";
  const Layout src_layout = parse_layout(op, "src_layout", src_layout_str);
  const Layout dst_layout = parse_layout(op, "dst_layout", dst_layout_str);
  PC_ARG(cu_seqlens.defined(), op, "cu_seqlens must be a tensor, got None");
  const std::vector<int64_t> cu =
      checked_layout_args(op, cu_seqlens, cp_size, cp_rank, src_layout, src_align, src_bucket);
  checked_layout_args(op, cu_seqlens, cp_size, cp_rank, dst_layout, dst_align, dst_bucket);
  check_schedule_cp(op, "cp_size", cp_size);
  const int64_t nseq = static_cast<int64_t>(cu.size()) - 1;
  const shard::HostLayout a = shard::build_layout(cu.data(), nseq, cp_size, cp_rank, layout_code(src_layout), src_align,
                                                  src_bucket.value_or(1));
  const shard::HostLayout b = shard::build_layout(cu.data(), nseq, cp_size, cp_rank, layout_code(dst_layout), dst_align,
                                                  dst_bucket.value_or(1));
  PC_ARG(a.cu_padded == b.cu_padded, op, "the two plans do not index one padded stream: src_align=", src_align,
         ", src_bucket=", src_bucket.value_or(0), " pad the batch to ", a.total_padded, " rows in ",
         a.cu_padded.size() - 1, " segments (", layout_name(src_layout), "), dst_align=", dst_align,
         ", dst_bucket=", dst_bucket.value_or(0), " to ", b.total_padded, " rows in ", b.cu_padded.size() - 1,
         " segments (", layout_name(dst_layout),
         "); build both plans with the same align (a multiple of 2*cp_size) and bucket");
  const int64_t nseg = static_cast<int64_t>(a.cu_padded.size()) - 1;
  return schedule_tensors(
      exchange::build_schedule(op, cp_size, cp_rank, a.total_local, b.total_local,
                               relayout::moves(a.cu_padded.data(), nseg, cp_size, cp_rank, layout_code(src_layout),
                                               layout_code(dst_layout), a.total_local)));
}

// The static move's tables of rank cp_rank between the two layouts of one static padded stream
// (cu_seqlens_padded int32 [max_seqs + 2] of either static plan; exchange/exchange_static.h, B = T_local =
// capacity / cp_size):
//   send    int64 [capacity]        this rank's slot that fills slot s of peer p at p*T_local + s (-1: zero row)
//   unpack  int64 [T_local]         row of the received [capacity] buffer that fills slot s of this rank
//   bwd     int64 [T_local, 1]      row of the gradient buffer sent back that this rank's src slot takes
// One launch, no sync; the values of cu_seqlens_padded are not trusted (any input gives -1 or an in-range row).
std::tuple<Tensor, Tensor, Tensor> relayout_static_tables(Tensor cu_seqlens_padded, int64_t cp_size, int64_t cp_rank,
                                                          std::string src_layout_str, std::string dst_layout_str,
                                                          int64_t capacity) {
  const char* op = "relayout_static_tables";
  const Layout src_layout = parse_layout(op, "src_layout", src_layout_str);
  const Layout dst_layout = parse_layout(op, "dst_layout", dst_layout_str);
  PC_ARG(cu_seqlens_padded.defined(), op, "cu_seqlens_padded must be a tensor, got None");
  const int64_t max_seqs = checked_static_layout(op, cu_seqlens_padded, cp_size, cp_rank, capacity);
  PC_ARG((src_layout != Layout::Zigzag && dst_layout != Layout::Zigzag) || capacity % (2 * cp_size) == 0, op,
         "capacity must be a multiple of 2*cp_size=", 2 * cp_size, " for the zigzag layout, got ", capacity);
  const int64_t total_local = capacity / cp_size;
  const Tensor cp = dense(cu_seqlens_padded);
  const Device dev = cp.device();
  Tensor send = new_tensor({capacity}, ST::Long, dev);
  Tensor unpack = new_tensor({total_local}, ST::Long, dev);
  Tensor bwd = new_tensor({total_local, 1}, ST::Long, dev);
  relayout::StaticRelayout r;
  r.cu_padded = cp.const_data_ptr<int32_t>();
  r.nseg = max_seqs + 1;
  r.cp = cp_size;
  r.rank = cp_rank;
  r.total_local = total_local;
  r.src_layout = layout_code(src_layout);
  r.dst_layout = layout_code(dst_layout);
  exchange::StaticTables t;
  t.send = send.mutable_data_ptr<int64_t>();
  t.n_send = capacity;
  t.unpack = unpack.mutable_data_ptr<int64_t>();
  t.n_unpack = total_local;
  t.bwd = bwd.mutable_data_ptr<int64_t>();
  t.n_bwd = total_local;
  run_kernel(
      cp, [&] { relayout::static_tables_cpu(r, t); }, [&](auto stream) { relayout::static_tables_cuda(r, t, stream); });
  return {send, unpack, bwd};
}

}  // namespace
}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def(
      "relayout_schedule(Tensor cu_seqlens, int cp_size, int cp_rank, str src_layout, int src_align, "
      "int? src_bucket, str dst_layout, int dst_align, int? dst_bucket) -> Tensor[]");
  m.def(
      "relayout_static_tables(Tensor cu_seqlens_padded, int cp_size, int cp_rank, str src_layout, str dst_layout, "
      "int capacity) -> (Tensor, Tensor, Tensor)");
}

// relayout_schedule takes host metadata (its CUDA registration only answers a device tensor with a clear error);
// relayout_static_tables runs on the device of its input.
#define PC_RELAYOUT_IMPLS(m)                                         \
  PC_IMPL(m, "relayout_schedule", &packcuda::th::relayout_schedule); \
  PC_IMPL(m, "relayout_static_tables", &packcuda::th::relayout_static_tables);

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) {PC_RELAYOUT_IMPLS(m)}
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) {
  PC_RELAYOUT_IMPLS(m)
}
#endif
