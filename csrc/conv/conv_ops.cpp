// Torch layer of the causal conv1d and the conv-prefix schedule: schemas, argument checks, dispatch.
#include <climits>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>

#include "common/checked.h"
#include "common/torch/checks.h"
#include "conv/conv.h"
#include "exchange/exchange_ops.h"
#include "shard/torch/shard_args.h"
#include "shard/shard_math.h"

namespace packcuda::th {
namespace {

using conv::ConvArgs;
using conv::DType;
using torch::stable::Device;

// A required tensor argument that was given (None reaches a Tensor argument as an undefined tensor).
void check_given(const char* op, const char* name, const Tensor& t) {
  PC_ARG(t.defined(), op, name, " must be a tensor, got None");
}

// The activation of the conv, by name (None, "silu" or its alias "swish"); values of ConvArgs::activation.
enum class Activation : int { Identity = 0, Silu = 1 };

Activation parse_activation(const char* op, const std::optional<std::string>& activation) {
  if (!activation.has_value()) return Activation::Identity;
  PC_ARG(*activation == "silu" || *activation == "swish", op, "activation must be None or 'silu', got '", *activation,
         "'");
  return Activation::Silu;
}

struct Prepared {
  ConvArgs a;
  Tensor x, weight, cu;
  std::vector<int64_t> cu_host;  // host cu_seqlens a CUDA launch takes in its parameters (a.cu_host)
  std::optional<Tensor> bias, prefix;
};

// Validates every argument of the conv (forward and backward) before anything is written.
Prepared prepare(const char* op, const Tensor& x_in, const Tensor& weight_in, const std::optional<Tensor>& bias,
                 const std::optional<Tensor>& cu_seqlens, const std::optional<Tensor>& prefix,
                 const std::optional<std::string>& activation) {
  check_given(op, "x", x_in);
  check_given(op, "weight", weight_in);
  check_dim(op, "x", x_in, 2);
  check_dtype(op, "x", x_in, {ST::BFloat16, ST::Half, ST::Float, ST::Double});
  check_dim(op, "weight", weight_in, 2);
  check_same_device(op, "weight", weight_in, "x", x_in);
  const int64_t T = x_in.size(0), C = x_in.size(1);
  PC_ARG(weight_in.scalar_type() == x_in.scalar_type(), op, "weight has dtype ", dtype_name(weight_in.scalar_type()),
         " but x has dtype ", dtype_name(x_in.scalar_type()));
  PC_ARG(weight_in.size(0) == C, op, "weight must be [C, K] with C = ", C, " (x is ", shape_str(x_in), "), got ",
         shape_str(weight_in));
  const int64_t K = weight_in.size(1);
  PC_ARG(K >= 1 && K <= conv::kMaxK, op, "kernel size K = weight.size(1) must be in [1, ", conv::kMaxK, "], got ", K);
  const Activation act = parse_activation(op, activation);
  Prepared p;
  p.x = dense(x_in);
  p.weight = dense(weight_in);
  if (bias.has_value()) {
    const Tensor& b = *bias;
    check_same_device(op, "bias", b, "x", x_in);
    PC_ARG(b.dim() == 1 && b.size(0) == C, op, "bias must be [C] with C = ", C, ", got ", shape_str(b));
    PC_ARG(b.scalar_type() == x_in.scalar_type(), op, "bias has dtype ", dtype_name(b.scalar_type()),
           " but x has dtype ", dtype_name(x_in.scalar_type()));
    p.bias = dense(b);
  }
  // Host cu_seqlens for a CUDA x travel in the kernels' parameters when they fit (conv::kInlineCu); else (and
  // for CPU x) cu is a tensor on x's device.
  const bool cuda = x_in.is_cuda();
  int64_t nseg = 1;
  if (cu_seqlens.has_value()) {
    const bool inl = cuda && cu_seqlens->is_cpu() && cu_seqlens->dim() == 1 && cu_seqlens->numel() <= conv::kInlineCu;
    Segments seg = segments(op, "cu_seqlens", *cu_seqlens, x_in.device(), T, /*upload=*/!inl);
    nseg = seg.count;
    if (inl) p.cu_host = std::move(seg.host);
    else p.cu = seg.tensor;
  } else if (cuda) {
    p.cu_host = {0, T};
  } else {
    p.cu = upload_i64({0, T}, x_in.device());
  }
  if (prefix.has_value()) {
    const Tensor& pf = *prefix;
    check_same_device(op, "prefix", pf, "x", x_in);
    PC_ARG(pf.dim() == 3 && pf.size(0) == nseg && pf.size(1) == K - 1 && pf.size(2) == C, op,
           "prefix must be [S, K-1, C] = [", nseg, ", ", K - 1, ", ", C, "], got ", shape_str(pf));
    PC_ARG(pf.scalar_type() == x_in.scalar_type(), op, "prefix has dtype ", dtype_name(pf.scalar_type()),
           " but x has dtype ", dtype_name(x_in.scalar_type()));
    p.prefix = dense(pf);
  }
  ConvArgs& a = p.a;
  a.x = p.x.const_data_ptr();
  a.weight = p.weight.const_data_ptr();
  a.bias = p.bias.has_value() ? p.bias->const_data_ptr() : nullptr;
  a.prefix = p.prefix.has_value() ? p.prefix->const_data_ptr() : nullptr;
  a.cu = p.cu_host.empty() ? p.cu.const_data_ptr<int64_t>() : nullptr;
  a.cu_host = p.cu_host.empty() ? nullptr : p.cu_host.data();  // (a moved Prepared keeps the vector's buffer)
  a.T = T;
  a.C = C;
  a.nseg = nseg;
  a.K = static_cast<int>(K);
  a.activation = static_cast<int>(act);
  a.dtype = core_dtype(x_in.scalar_type());
  return p;
}

Tensor causal_conv1d_fwd(Tensor x, Tensor weight, std::optional<Tensor> bias, std::optional<Tensor> cu_seqlens,
                         std::optional<Tensor> prefix, std::optional<std::string> activation) {
  Prepared p = prepare("causal_conv1d", x, weight, bias, cu_seqlens, prefix, activation);
  Tensor y = new_like(p.x, {p.a.T, p.a.C});
  if (p.a.T == 0 || p.a.C == 0) return y;
  run_kernel(
      x, [&] { conv::causal_conv1d_fwd_cpu(p.a, y.mutable_data_ptr()); },
      [&](auto stream) { conv::causal_conv1d_fwd_cuda(p.a, y.mutable_data_ptr(), stream); });
  return y;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> causal_conv1d_bwd(Tensor dy, Tensor x, Tensor weight,
                                                             std::optional<Tensor> bias,
                                                             std::optional<Tensor> cu_seqlens,
                                                             std::optional<Tensor> prefix,
                                                             std::optional<std::string> activation) {
  const char* op = "causal_conv1d_bwd";
  check_given(op, "grad_y", dy);
  Prepared p = prepare(op, x, weight, bias, cu_seqlens, prefix, activation);
  check_same_device(op, "grad_y", dy, "x", x);
  PC_ARG(dy.dim() == 2 && dy.size(0) == p.a.T && dy.size(1) == p.a.C, op, "grad_y must have the shape of x ",
         shape_str(x), ", got ", shape_str(dy));
  PC_ARG(dy.scalar_type() == x.scalar_type(), op, "grad_y has dtype ", dtype_name(dy.scalar_type()),
         " but x has dtype ", dtype_name(x.scalar_type()));
  dy = dense(dy);
  const conv::ConvArgs& a = p.a;
  Tensor dx = new_like(p.x, {a.T, a.C});
  Tensor dw = new_like(p.weight, {a.C, static_cast<int64_t>(a.K)});
  Tensor db = new_like(p.x, {a.C});
  const int64_t S = p.prefix.has_value() ? a.nseg : 0;
  Tensor dprefix = new_like(p.x, {S, static_cast<int64_t>(a.K - 1), a.C});
  const ST acc_t = a.dtype == DType::F64 ? ST::Double : ST::Float;
  run_kernel(
      x,
      [&] {
        const int64_t tiles = conv::conv_bwd_tiles_cpu(a.T);
        Tensor work = new_like(p.x, {conv::conv_bwd_work_elems(tiles, a.C, a.K)}, acc_t);
        conv::causal_conv1d_bwd_cpu(a, dy.const_data_ptr(), dx.mutable_data_ptr(), dw.mutable_data_ptr(),
                                    db.mutable_data_ptr(), S ? dprefix.mutable_data_ptr() : nullptr,
                                    work.mutable_data_ptr(), tiles);
      },
      [&](auto stream) {
        const int64_t tiles = conv::conv_bwd_tiles_cuda(a);
        Tensor work = new_like(p.x, {conv::conv_bwd_work_elems(tiles, a.C, a.K)}, acc_t);
        conv::causal_conv1d_bwd_cuda(a, dy.const_data_ptr(), dx.mutable_data_ptr(), dw.mutable_data_ptr(),
                                     db.mutable_data_ptr(), S ? dprefix.mutable_data_ptr() : nullptr,
                                     work.mutable_data_ptr(), tiles, stream);
      });
  return {dx, dw, db, dprefix};
}

// The layout arguments of a schedule: the shard layout's own validation (the schedule is built from the same
// shard::build_layout, so a bad value gets shard_plan's message), then a bound on cp_size (the schedule keeps
// lists for every peer). Returns the validated host cu_seqlens.
std::vector<int64_t> checked_schedule_layout(const char* op, const Tensor& cu_seqlens, int64_t cp_size, int64_t cp_rank,
                                             Layout layout, int64_t align, std::optional<int64_t> bucket) {
  check_given(op, "cu_seqlens", cu_seqlens);
  std::vector<int64_t> cu = checked_layout_args(op, cu_seqlens, cp_size, cp_rank, layout, align, bucket);
  check_schedule_cp(op, "cp_size", cp_size);
  return cu;
}

// Host schedule of the conv-prefix exchange for rank cp_rank of a shard plan (parameters as shard_plan): the
// conv prefix's moves (conv::prefix_moves) through the row exchange (exchange::build_schedule); output slot
// piece * (K-1) + j is prefix row j of local piece `piece`. The outputs of schedule_tensors.
std::vector<Tensor> conv_prefix_schedule(Tensor cu_seqlens, int64_t cp_size, int64_t cp_rank, std::string layout_str,
                                         int64_t align, std::optional<int64_t> bucket, int64_t kernel_size) {
  const char* op = "conv_prefix_schedule";
  const Layout layout = parse_layout(op, "layout", layout_str);
  PC_ARG(kernel_size >= 1 && kernel_size <= conv::kMaxK, op, "kernel_size must be in [1, ", conv::kMaxK, "], got ",
         kernel_size);
  const std::vector<int64_t> cu = checked_schedule_layout(op, cu_seqlens, cp_size, cp_rank, layout, align, bucket);
  const int64_t nseq = static_cast<int64_t>(cu.size()) - 1;
  conv::PrefixMoves pm = conv::prefix_moves(cu.data(), nseq, cp_size, cp_rank, layout_code(layout), align,
                                            bucket.value_or(1), static_cast<int>(kernel_size));
  return schedule_tensors(
      exchange::build_schedule(op, cp_size, cp_rank, pm.n_local, pm.n_pieces * (kernel_size - 1), std::move(pm.moves)));
}

// The conv-prefix tables of a static plan on rank cp_rank, for kernel size K (k1 = K-1, SQ = S*k1), as the static
// move's tables (exchange/exchange_static.h, B = SQ):
//   send    int64 [cp_size * SQ]       local row filling prefix slot q of peer p at p*SQ + q (-1: zero row)
//   unpack  int64 [SQ]                 row of the received [cp_size * SQ] buffer that is this rank's slot q
//   bwd     int64 [T_local, k1]        rows of the gradient buffer sent back ([cp_size * SQ]) that each local
//                                      row sums (-1: none), in a fixed order
// from the plan's own pieces / piece_offset / piece_seq and the global cu_seqlens_padded; one launch, no sync.
std::tuple<Tensor, Tensor, Tensor> conv_static_prefix_tables(Tensor pieces, Tensor piece_offset, Tensor piece_seq,
                                                             Tensor cu_seqlens_padded, int64_t cp_size, int64_t cp_rank,
                                                             std::string layout_str, int64_t capacity,
                                                             int64_t kernel_size) {
  const char* op = "conv_static_prefix_tables";
  const Layout layout = parse_layout(op, "layout", layout_str);
  PC_ARG(kernel_size >= 2 && kernel_size <= conv::kMaxK, op, "kernel_size must be in [2, ", conv::kMaxK,
         "] (K = 1 has no prefix), got ", kernel_size);
  check_given(op, "cu_seqlens_padded", cu_seqlens_padded);
  const int64_t max_seqs = checked_static_layout(op, cu_seqlens_padded, cp_size, cp_rank, capacity);
  const int64_t np = checked_static_pieces(op, pieces, piece_offset, piece_seq, cu_seqlens_padded, layout, max_seqs);
  const int64_t k1 = kernel_size - 1, total_local = capacity / cp_size;
  // cp_size * S * k1 rows: the worst case, checked (cp_size and S are each below 2**31)
  const int64_t n_send = checked::mul(op, "cp_size * pieces * (kernel_size - 1)", cp_size, np * k1);
  const Tensor pc = dense(pieces), po = dense(piece_offset), ps = dense(piece_seq), cp = dense(cu_seqlens_padded);
  const Device dev = cp.device();
  Tensor send = new_tensor({n_send}, ST::Long, dev);
  Tensor unpack = new_tensor({np * k1}, ST::Long, dev);
  Tensor bwd = new_tensor({total_local, k1}, ST::Long, dev);
  conv::StaticPrefix p;
  p.pieces = pc.const_data_ptr<int32_t>();
  p.piece_offset = po.const_data_ptr<int64_t>();
  p.piece_seq = ps.const_data_ptr<int32_t>();
  p.cu_padded = cp.const_data_ptr<int32_t>();
  p.max_seqs = max_seqs;
  p.cp = cp_size;
  p.rank = cp_rank;
  p.total_local = total_local;
  p.k1 = k1;
  p.npieces = np;
  p.layout = layout_code(layout);
  exchange::StaticTables t;
  t.send = send.mutable_data_ptr<int64_t>();
  t.n_send = n_send;
  t.unpack = unpack.mutable_data_ptr<int64_t>();
  t.n_unpack = np * k1;
  t.bwd = bwd.mutable_data_ptr<int64_t>();
  t.n_bwd = total_local * k1;
  run_kernel(
      cp, [&] { conv::static_prefix_tables_cpu(p, t); },
      [&](auto stream) { conv::static_prefix_tables_cuda(p, t, stream); });
  return {send, unpack, bwd};
}
}  // namespace
}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def(
      "causal_conv1d_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? cu_seqlens, Tensor? prefix, "
      "str? activation=None) -> Tensor");
  m.def(
      "causal_conv1d_bwd(Tensor grad_y, Tensor x, Tensor weight, Tensor? bias, Tensor? cu_seqlens, "
      "Tensor? prefix, str? activation=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "conv_prefix_schedule(Tensor cu_seqlens, int cp_size, int cp_rank, str layout, int align, int? bucket, "
      "int kernel_size) -> Tensor[]");
  m.def(
      "conv_static_prefix_tables(Tensor pieces, Tensor piece_offset, Tensor piece_seq, Tensor cu_seqlens_padded, "
      "int cp_size, int cp_rank, str layout, int capacity, int kernel_size) -> (Tensor, Tensor, Tensor)");
}

#define PC_CONV_IMPLS(m)                                             \
  PC_IMPL(m, "causal_conv1d_fwd", &packcuda::th::causal_conv1d_fwd); \
  PC_IMPL(m, "causal_conv1d_bwd", &packcuda::th::causal_conv1d_bwd); \
  PC_IMPL(m, "conv_static_prefix_tables", &packcuda::th::conv_static_prefix_tables);

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) {
  PC_CONV_IMPLS(m)
  PC_IMPL(m, "conv_prefix_schedule", &packcuda::th::conv_prefix_schedule);
}
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) {
  PC_CONV_IMPLS(m)
  PC_IMPL(m, "conv_prefix_schedule", &packcuda::th::conv_prefix_schedule);  // refuses device metadata
}
#endif
