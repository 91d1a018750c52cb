// Torch layer of the causal conv1d and the conv-prefix exchange: schemas, argument checks, dispatch.
#include <climits>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <set>
#include <string>

#include "common/checked.h"
#include "common/torch/checks.h"
#include "conv/conv.h"
#include "shard/torch/shard_args.h"
#include "shard/shard_math.h"

namespace packcuda::th {
namespace {

using torch::stable::Device;
using conv::ConvArgs;
using conv::DType;


// A required tensor argument that was given (None reaches a Tensor argument as an undefined tensor).
void check_given(const char* op, const char* name, const Tensor& t) {
  PC_ARG(t.defined(), op, name, " must be a tensor, got None");
}

// The activation of the conv, by name (None, "silu" or its alias "swish"); values of ConvArgs::activation.
enum class Activation : int { Identity = 0, Silu = 1 };

Activation parse_activation(const char* op, const std::optional<std::string>& activation) {
  if (!activation.has_value()) return Activation::Identity;
  PC_ARG(*activation == "silu" || *activation == "swish", op, "activation must be None or 'silu', got '",
         *activation, "'");
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
  PC_ARG(weight_in.scalar_type() == x_in.scalar_type(), op, "weight has dtype ",
         dtype_name(weight_in.scalar_type()), " but x has dtype ", dtype_name(x_in.scalar_type()));
  PC_ARG(weight_in.size(0) == C, op, "weight must be [C, K] with C = ", C, " (x is ", shape_str(x_in),
         "), got ", shape_str(weight_in));
  const int64_t K = weight_in.size(1);
  PC_ARG(K >= 1 && K <= conv::kMaxK, op, "kernel size K = weight.size(1) must be in [1, ", conv::kMaxK,
         "], got ", K);
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
    const bool inl =
        cuda && cu_seqlens->is_cpu() && cu_seqlens->dim() == 1 && cu_seqlens->numel() <= conv::kInlineCu;
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
  run_kernel(x, [&] {
    conv::causal_conv1d_fwd_cpu(p.a, y.mutable_data_ptr());
  }, [&](auto stream) {
    conv::causal_conv1d_fwd_cuda(p.a, y.mutable_data_ptr(), stream);
  });
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
  run_kernel(x, [&] {
    const int64_t tiles = conv::conv_bwd_tiles_cpu(a.T);
    Tensor work = new_like(p.x, {conv::conv_bwd_work_elems(tiles, a.C, a.K)}, acc_t);
    conv::causal_conv1d_bwd_cpu(a, dy.const_data_ptr(), dx.mutable_data_ptr(), dw.mutable_data_ptr(),
                                db.mutable_data_ptr(), S ? dprefix.mutable_data_ptr() : nullptr,
                                work.mutable_data_ptr(), tiles);
  }, [&](auto stream) {
    const int64_t tiles = conv::conv_bwd_tiles_cuda(a);
    Tensor work = new_like(p.x, {conv::conv_bwd_work_elems(tiles, a.C, a.K)}, acc_t);
    conv::causal_conv1d_bwd_cuda(a, dy.const_data_ptr(), dx.mutable_data_ptr(), dw.mutable_data_ptr(),
                                 db.mutable_data_ptr(), S ? dprefix.mutable_data_ptr() : nullptr,
                                 work.mutable_data_ptr(), tiles, stream);
  });
  return {dx, dw, db, dprefix};
}

// out[r] = sum_m src(index[r, m]) with src(i) = a[i] for i < a.size(0), b[i - a.size(0)] above, nothing for -1.
Tensor conv_gather_sum(Tensor a, Tensor b, Tensor index) {
  const char* op = "conv_gather_sum";
  check_given(op, "a", a);
  check_given(op, "b", b);
  check_given(op, "index", index);
  check_dim(op, "a", a, 2);
  check_dim(op, "b", b, 2);
  check_dtype(op, "a", a, {ST::BFloat16, ST::Half, ST::Float, ST::Double});
  PC_ARG(b.scalar_type() == a.scalar_type(), op, "b has dtype ", dtype_name(b.scalar_type()), " but a has ",
         dtype_name(a.scalar_type()));
  PC_ARG(b.size(1) == a.size(1), op, "b has ", b.size(1), " columns but a has ", a.size(1));
  check_same_device(op, "b", b, "a", a);
  check_same_device(op, "index", index, "a", a);
  check_dim(op, "index", index, 2);
  check_dtype(op, "index", index, {ST::Long});
  PC_ARG(index.size(1) <= INT_MAX, op, "index may hold at most ", INT_MAX, " sources per row, got ", index.size(1));
  a = dense(a);
  b = dense(b);
  index = dense(index);
  const int64_t na = a.size(0), nb = b.size(0), C = a.size(1), R = index.size(0);
  const int M = static_cast<int>(index.size(1));
  if (a.is_cpu()) check_index_range(op, "index", index, -1, na + nb, false);
  Tensor out = new_like(a, {R, C});
  if (R == 0 || C == 0) return out;
  const DType dt = core_dtype(a.scalar_type());
  run_kernel(a, [&] {
    conv::gather_sum_cpu(out.mutable_data_ptr(), R, a.const_data_ptr(), na, b.const_data_ptr(),
                         index.const_data_ptr<int64_t>(), M, C, dt);
  }, [&](auto stream) {
    conv::gather_sum_cuda(out.mutable_data_ptr(), R, a.const_data_ptr(), na, b.const_data_ptr(),
                          index.const_data_ptr<int64_t>(), M, C, dt, stream);
  });
  return out;
}


Tensor host_i64(const std::vector<int64_t>& v) {
  return upload_i64(v, Device(torch::headeronly::DeviceType::CPU));
}

// Largest CP size a schedule is built for: every rank's schedule walks the layouts of all cp ranks and keeps
// per-peer lists (O(cp) memory, O(cp * pieces * K) host work).
constexpr int64_t kMaxScheduleCp = 1 << 16;

// The layout arguments of a schedule: the shard layout's own validation (the schedule is built from the same
// shard::build_layout, so a bad value gets shard_plan's message), then a bound on cp_size (the schedule keeps
// lists for every peer). Returns the validated host cu_seqlens.
std::vector<int64_t> checked_schedule_layout(const char* op, const Tensor& cu_seqlens, int64_t cp_size,
                                             int64_t cp_rank, int64_t layout, int64_t align,
                                             std::optional<int64_t> bucket) {
  check_given(op, "cu_seqlens", cu_seqlens);
  std::vector<int64_t> cu = checked_layout_args(op, cu_seqlens, cp_size, cp_rank, layout, align, bucket);
  PC_ARG(cp_size <= kMaxScheduleCp, op, "cp_size must be <= ", kMaxScheduleCp,
         " (a schedule keeps lists for every peer), got ", cp_size);
  return cu;
}

// Host schedule of the conv-prefix exchange for rank cp_rank of a shard plan (parameters as shard_plan):
// [send_index, send_counts, recv_counts, unpack, bwd_send_index, bwd_unpack [n_local, bwd_m],
//  (n_pieces, n_local), send_first, bwd_send_first] (conv::Schedule).
std::vector<Tensor> conv_prefix_schedule(Tensor cu_seqlens, int64_t cp_size, int64_t cp_rank, int64_t layout,
                                         int64_t align, std::optional<int64_t> bucket, int64_t kernel_size) {
  const char* op = "conv_prefix_schedule";
  PC_ARG(kernel_size >= 1 && kernel_size <= conv::kMaxK, op, "kernel_size must be in [1, ", conv::kMaxK, "], got ",
         kernel_size);
  const std::vector<int64_t> cu = checked_schedule_layout(op, cu_seqlens, cp_size, cp_rank, layout, align, bucket);
  const int64_t nseq = static_cast<int64_t>(cu.size()) - 1;
  const conv::Schedule sc = conv::build_schedule(cu.data(), nseq, cp_size, cp_rank, static_cast<int>(layout), align,
                                                 bucket.value_or(1), static_cast<int>(kernel_size));
  Tensor bwd_unpack = torch::stable::reshape(host_i64(sc.bwd_unpack), {sc.n_local, sc.bwd_m});
  return {host_i64(sc.send_index), host_i64(sc.send_counts), host_i64(sc.recv_counts), host_i64(sc.unpack),
          host_i64(sc.bwd_send_index), bwd_unpack, host_i64({sc.n_pieces, sc.n_local}), host_i64(sc.send_first),
          host_i64(sc.bwd_send_first)};
}

bool conv_nccl_available() { return conv::nccl_available(); }

Tensor conv_nccl_unique_id() {
  Tensor id = torch::stable::empty({128}, ST::Byte, std::nullopt, Device(torch::headeronly::DeviceType::CPU));
  conv::nccl_unique_id(static_cast<uint8_t*>(id.mutable_data_ptr()));
  return id;
}

// Communicators made by conv_nccl_comm_init: a prepared exchange only takes one of these (an arbitrary integer
// would be dereferenced by NCCL). Never destroyed, like the exchange registry below.
std::mutex& comm_mutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::set<int64_t>& comms() {
  static auto* s = new std::set<int64_t>();
  return *s;
}

int64_t conv_nccl_comm_init(Tensor unique_id, int64_t nranks, int64_t rank, int64_t device_index) {
  const char* op = "conv_nccl_comm_init";
  check_given(op, "unique_id", unique_id);
  PC_ARG(unique_id.is_cpu() && unique_id.scalar_type() == ST::Byte && unique_id.numel() == 128, op,
         "unique_id must be a CPU uint8 tensor of 128 bytes, got ", dtype_name(unique_id.scalar_type()), " ",
         shape_str(unique_id), " on ", device_str(unique_id));
  PC_ARG(nranks >= 1 && nranks <= INT_MAX, op, "nranks must be in [1, ", INT_MAX, "], got ", nranks);
  PC_ARG(rank >= 0 && rank < nranks, op, "rank ", rank, " is not in [0, nranks=", nranks, ")");
  PC_ARG(device_index >= 0 && device_index <= INT32_MAX, op, "device_index must be a CUDA device index >= 0, got ",
         device_index);
  if (!conv::nccl_available())
    throw std::runtime_error("packcuda.conv_nccl_comm_init: packcuda was built without NCCL (nccl.h not found)");
  unique_id = dense(unique_id);
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  try {
    guard.emplace(static_cast<int32_t>(device_index));
  } catch (const std::exception& e) {
    PC_ARG(false, op, "device_index=", device_index, " is not a usable CUDA device (", e.what(), ")");
  }
  const int64_t comm = reinterpret_cast<int64_t>(
      conv::nccl_comm_init(static_cast<const uint8_t*>(unique_id.const_data_ptr()), static_cast<int>(nranks),
                           static_cast<int>(rank)));
  std::lock_guard<std::mutex> lock(comm_mutex());
  comms().insert(comm);
  return comm;
}

// Prepared exchanges: one direction of a cached conv-prefix call (schedule tensors, counts, communicator,
// output shape), kept here so that a call passes one tensor and one handle: the per-call host path is the
// argument check, two allocations, the kernels and the NCCL group. Handles live until released (the Python
// call object releases its own); the registry itself is never destroyed, so nothing runs at process exit.
struct Exchange {
  Tensor send_index, unpack;
  std::vector<int64_t> send_counts, recv_counts, send_first, out_lead;
  int64_t n_src = 0, n_send = 0, n_recv = 0, comm = 0, rank = 0;
  bool direct = false;
};

std::mutex& exchange_mutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::vector<std::shared_ptr<const Exchange>>& exchanges() {
  static auto* v = new std::vector<std::shared_ptr<const Exchange>>();
  return *v;
}

// Every argument is checked (lists, counts, sizes, tensors, then the communicator) before anything is kept.
// The index values live on the device and are not read here (no sync): send_index must hold rows in
// [0, n_src) and unpack_index values in [-1, n_src + sum(recv_counts)), as a Schedule's lists do.
int64_t conv_exchange_prepare(Tensor send_index, std::vector<int64_t> send_counts, std::vector<int64_t> recv_counts,
                              std::vector<int64_t> send_first, Tensor unpack_index, int64_t comm, int64_t rank,
                              int64_t n_src, std::vector<int64_t> out_lead) {
  const char* op = "conv_exchange_prepare";
  check_given(op, "send_index", send_index);
  check_given(op, "unpack_index", unpack_index);
  const int64_t cp = static_cast<int64_t>(send_counts.size());
  PC_ARG(cp >= 1, op, "send_counts must have one entry per rank (cp >= 1), got an empty list");
  PC_ARG(static_cast<int64_t>(recv_counts.size()) == cp && static_cast<int64_t>(send_first.size()) == cp, op,
         "send_counts, recv_counts and send_first must have cp entries each, got ", cp, ", ", recv_counts.size(),
         ", ", send_first.size());
  PC_ARG(rank >= 0 && rank < cp, op, "rank ", rank, " is not in [0, cp=", cp, ")");
  PC_ARG(n_src >= 0, op, "n_src must be >= 0, got ", n_src);
  auto e = std::make_shared<Exchange>();
  for (int64_t p = 0; p < cp; ++p) {
    PC_ARG(send_counts[p] >= 0, op, "send_counts[", p, "] must be >= 0, got ", send_counts[p]);
    PC_ARG(recv_counts[p] >= 0, op, "recv_counts[", p, "] must be >= 0, got ", recv_counts[p]);
    PC_ARG(send_first[p] < 0 || checked::add(op, "send_first + send_counts", send_first[p], send_counts[p]) <= n_src,
           op, "send_first[", p, "] = ", send_first[p], " with ", send_counts[p], " rows runs past the ", n_src,
           " source rows");
    e->n_send = checked::add(op, "the sum of send_counts", e->n_send, send_counts[p]);
    e->n_recv = checked::add(op, "the sum of recv_counts", e->n_recv, recv_counts[p]);
  }
  int64_t lead = 1;
  for (size_t i = 0; i < out_lead.size(); ++i) {
    PC_ARG(out_lead[i] >= 0, op, "out_lead[", i, "] must be >= 0, got ", out_lead[i]);
    lead = checked::mul(op, "the product of out_lead", lead, out_lead[i]);
  }
  check_dtype(op, "send_index", send_index, {ST::Long});
  check_dtype(op, "unpack_index", unpack_index, {ST::Long});
  check_dim(op, "send_index", send_index, 1);
  check_dim(op, "unpack_index", unpack_index, 2);
  PC_ARG(send_index.numel() == e->n_send, op, "send_index has ", send_index.numel(),
         " entries but send_counts sum to ", e->n_send);
  PC_ARG(lead == unpack_index.size(0), op, "out_lead ", out_lead.size(), " dims hold ", lead,
         " rows but unpack_index has ", unpack_index.size(0));
  PC_ARG(unpack_index.size(1) <= INT_MAX, op, "unpack_index may hold at most ", INT_MAX, " sources per row, got ",
         unpack_index.size(1));
  check_same_device(op, "unpack_index", unpack_index, "send_index", send_index);
  PC_ARG(send_index.is_cuda(), op, "send_index must be a CUDA tensor, got ", device_str(send_index));
  {
    std::lock_guard<std::mutex> lock(comm_mutex());
    PC_ARG(comms().count(comm) == 1, op, "comm=", comm, " is not a communicator from conv_nccl_comm_init");
  }
  e->send_index = dense(send_index);
  e->unpack = dense(unpack_index);
  e->direct = conv::sends_direct(send_counts.data(), send_first.data(), cp, rank);
  e->send_counts = std::move(send_counts);
  e->recv_counts = std::move(recv_counts);
  e->send_first = std::move(send_first);
  e->out_lead = std::move(out_lead);
  e->n_src = n_src;
  e->comm = comm;
  e->rank = rank;
  std::lock_guard<std::mutex> lock(exchange_mutex());
  exchanges().push_back(std::move(e));
  return static_cast<int64_t>(exchanges().size());
}

// The exchange of a live handle (kept alive by the returned pointer even if it is released meanwhile).
std::shared_ptr<const Exchange> exchange_of(const char* op, int64_t handle) {
  std::lock_guard<std::mutex> lock(exchange_mutex());
  auto& v = exchanges();
  PC_ARG(handle >= 1 && handle <= static_cast<int64_t>(v.size()) && v[handle - 1], op, "unknown or released handle ",
         handle);
  return v[handle - 1];
}

// Releasing a released handle again is a no-op; a handle that was never issued is refused.
void conv_exchange_release(int64_t handle) {
  std::lock_guard<std::mutex> lock(exchange_mutex());
  auto& v = exchanges();
  PC_ARG(handle >= 1 && handle <= static_cast<int64_t>(v.size()), "conv_exchange_release", "unknown handle ", handle,
         " (handles come from conv_exchange_prepare)");
  v[handle - 1].reset();
}

// Runs a prepared exchange on src [n_src, C] (or any [..., C] holding n_src rows); returns [*out_lead, C].
// out_lead is the prepared one, passed again so that the fake kernel has the output shape from the arguments.
Tensor conv_exchange_run(Tensor src, int64_t handle, std::vector<int64_t> out_lead) {
  const char* op = "conv_exchange_run";
  const std::shared_ptr<const Exchange> ep = exchange_of(op, handle);
  const Exchange& e = *ep;
  check_given(op, "src", src);
  PC_ARG(src.is_cuda(), op, "src must be a CUDA tensor, got ", device_str(src));
  PC_ARG(src.dim() >= 2, op, "src must be [rows, C] (or [..., C]), got ", shape_str(src));
  check_dtype(op, "src", src, {ST::BFloat16, ST::Half, ST::Float, ST::Double});
  check_same_device(op, "src", src, "the prepared exchange", e.send_index);
  const int64_t C = src.size(src.dim() - 1);
  PC_ARG(C == 0 || src.numel() / C == e.n_src, op, "src has ", C == 0 ? 0 : src.numel() / C,
         " rows but the exchange was prepared for ", e.n_src);
  PC_ARG(out_lead == e.out_lead, op, "out_lead ", list_str(out_lead), " is not the prepared exchange's ",
         list_str(e.out_lead));
  src = dense(src);
  std::vector<int64_t> out_sizes = e.out_lead;
  out_sizes.push_back(C);
  const int64_t n_stage = (e.direct ? 0 : e.n_send) + e.n_recv;
  Tensor staging = new_like(src, {n_stage, C});
  Tensor out = new_like(src, out_sizes);
  // src is on CUDA (checked above): the host half is never taken.
  run_kernel(src, [] {}, [&](auto stream) {
    char* base = static_cast<char*>(staging.mutable_data_ptr());
    const int64_t row_bytes = C * element_size(src.scalar_type());
    char* send_ptr = e.direct ? nullptr : base;
    char* recv_ptr = base + (e.direct ? 0 : e.n_send * row_bytes);
    conv::exchange_rows_nccl(src.const_data_ptr(), e.n_src, e.send_index.const_data_ptr<int64_t>(),
                             e.send_counts.data(), e.recv_counts.data(), e.send_first.data(), send_ptr, recv_ptr,
                             e.unpack.const_data_ptr<int64_t>(), static_cast<int>(e.unpack.size(1)),
                             out.mutable_data_ptr(), e.unpack.size(0), C, core_dtype(src.scalar_type()),
                             static_cast<int64_t>(e.send_counts.size()), e.rank,
                             reinterpret_cast<ncclComm_t>(e.comm), stream);
  });
  return out;
}
}  // namespace
}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def("causal_conv1d_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? cu_seqlens, Tensor? prefix, "
        "str? activation=None) -> Tensor");
  m.def("causal_conv1d_bwd(Tensor grad_y, Tensor x, Tensor weight, Tensor? bias, Tensor? cu_seqlens, "
        "Tensor? prefix, str? activation=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("conv_gather_sum(Tensor a, Tensor b, Tensor index) -> Tensor");
  m.def("conv_prefix_schedule(Tensor cu_seqlens, int cp_size, int cp_rank, int layout, int align, int? bucket, "
        "int kernel_size) -> Tensor[]");
  m.def("conv_nccl_available() -> bool");
  m.def("conv_nccl_unique_id() -> Tensor");
  m.def("conv_nccl_comm_init(Tensor unique_id, int nranks, int rank, int device_index) -> int");
  m.def("conv_exchange_prepare(Tensor send_index, int[] send_counts, int[] recv_counts, int[] send_first, "
        "Tensor unpack_index, int comm, int rank, int n_src, int[] out_lead) -> int");
  m.def("conv_exchange_run(Tensor src, int handle, int[] out_lead) -> Tensor");
  m.def("conv_exchange_release(int handle) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(packcuda, CompositeExplicitAutograd, m) {
  PC_IMPL(m, "conv_nccl_available", &packcuda::th::conv_nccl_available);
  PC_IMPL(m, "conv_nccl_unique_id", &packcuda::th::conv_nccl_unique_id);
  PC_IMPL(m, "conv_nccl_comm_init", &packcuda::th::conv_nccl_comm_init);
  PC_IMPL(m, "conv_exchange_prepare", &packcuda::th::conv_exchange_prepare);
  PC_IMPL(m, "conv_exchange_release", &packcuda::th::conv_exchange_release);
}

#define PC_CONV_IMPLS(m)                                             \
  PC_IMPL(m, "causal_conv1d_fwd", &packcuda::th::causal_conv1d_fwd); \
  PC_IMPL(m, "causal_conv1d_bwd", &packcuda::th::causal_conv1d_bwd); \
  PC_IMPL(m, "conv_gather_sum", &packcuda::th::conv_gather_sum);

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) {
  PC_CONV_IMPLS(m)
  PC_IMPL(m, "conv_prefix_schedule", &packcuda::th::conv_prefix_schedule);
  PC_IMPL(m, "conv_exchange_run", &packcuda::th::conv_exchange_run);  // refuses: the exchange runs on CUDA
}
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) {
  PC_CONV_IMPLS(m)
  PC_IMPL(m, "conv_prefix_schedule", &packcuda::th::conv_prefix_schedule);  // refuses device metadata
  PC_IMPL(m, "conv_exchange_run", &packcuda::th::conv_exchange_run);
}
#endif
