// Torch layer of the row exchange: the unpack step (exchange_gather_sum), schedules from moves
// (exchange_schedule), the dedicated NCCL communicator and the prepared NCCL move (exchange_prepare / _run /
// _release).
#include <climits>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>

#include "common/checked.h"
#include "exchange/exchange_ops.h"

namespace packcuda::th {
namespace {

using torch::stable::Device;

void check_given(const char* op, const char* name, const Tensor& t) {
  PC_ARG(t.defined(), op, name, " must be a tensor, got None");
}

Tensor host_i64(const std::vector<int64_t>& v) { return upload_i64(v, Device(torch::headeronly::DeviceType::CPU)); }

// Rows that a move copies (one source per row) may have any dtype of 1, 2, 4 or 8 bytes; rows that sum several
// sources (M > 1) need a floating dtype.
void check_rows_dtype(const char* op, const char* name, const Tensor& t, int64_t M) {
  if (M == 1) check_row_dtype(op, name, t);
  else
    PC_ARG(t.scalar_type() == ST::BFloat16 || t.scalar_type() == ST::Half || t.scalar_type() == ST::Float ||
               t.scalar_type() == ST::Double,
           op, name, " must have dtype bfloat16, float16, float32 or float64 to sum ", M, " sources per row, got ",
           dtype_name(t.scalar_type()));
}

// out[r] = sum_m src(index[r, m]) with src(i) = a[i] for i < a.size(0), b[i - a.size(0)] above, nothing for -1.
Tensor exchange_gather_sum(Tensor a, Tensor b, Tensor index) {
  const char* op = "exchange_gather_sum";
  check_given(op, "a", a);
  check_given(op, "b", b);
  check_given(op, "index", index);
  check_dim(op, "a", a, 2);
  check_dim(op, "b", b, 2);
  check_same_device(op, "b", b, "a", a);
  check_same_device(op, "index", index, "a", a);
  check_dim(op, "index", index, 2);
  check_dtype(op, "index", index, {ST::Long});
  PC_ARG(index.size(1) <= INT_MAX, op, "index may hold at most ", INT_MAX, " sources per row, got ", index.size(1));
  check_rows_dtype(op, "a", a, index.size(1));
  PC_ARG(b.scalar_type() == a.scalar_type(), op, "b has dtype ", dtype_name(b.scalar_type()), " but a has ",
         dtype_name(a.scalar_type()));
  PC_ARG(b.size(1) == a.size(1), op, "b has ", b.size(1), " columns but a has ", a.size(1));
  a = dense(a);
  b = dense(b);
  index = dense(index);
  const int64_t na = a.size(0), nb = b.size(0), C = a.size(1), R = index.size(0);
  if (a.is_cpu()) check_index_range(op, "index", index, -1, na + nb, false);
  Tensor out = new_like(a, {R, C});
  if (R == 0 || C == 0) return out;
  exchange::GatherSum g;
  g.out = out.mutable_data_ptr();
  g.n_out = R;
  g.a = a.const_data_ptr();
  g.na = na;
  g.b = b.const_data_ptr();
  g.index = index.const_data_ptr<int64_t>();
  g.M = static_cast<int>(index.size(1));
  g.C = C;
  g.elem_size = static_cast<int>(element_size(a.scalar_type()));
  g.dtype = core_dtype(a.scalar_type());
  run_kernel(a, [&] { exchange::gather_sum_cpu(g); }, [&](auto stream) { exchange::gather_sum_cuda(g, stream); });
  return out;
}

// The schedule of rank cp_rank from moves given as four host int64 tensors of equal length (moves that involve
// neither this rank's source nor its output are ignored): schedule_tensors' outputs.
std::vector<Tensor> exchange_schedule(int64_t cp_size, int64_t cp_rank, int64_t n_src, int64_t n_out, Tensor src_rank,
                                      Tensor src_row, Tensor dst_rank, Tensor dst_slot) {
  const char* op = "exchange_schedule";
  PC_ARG(cp_size >= 1, op, "cp_size must be >= 1, got ", cp_size);
  check_schedule_cp(op, "cp_size", cp_size);
  PC_ARG(cp_rank >= 0 && cp_rank < cp_size, op, "cp_rank must be in [0, cp_size=", cp_size, "), got ", cp_rank);
  PC_ARG(n_src >= 0, op, "n_src must be >= 0, got ", n_src);
  PC_ARG(n_out >= 0, op, "n_out must be >= 0, got ", n_out);
  const char* names[4] = {"src_rank", "src_row", "dst_rank", "dst_slot"};
  const Tensor* cols[4] = {&src_rank, &src_row, &dst_rank, &dst_slot};
  std::vector<int64_t> v[4];
  for (int k = 0; k < 4; ++k) {
    const Tensor& t = *cols[k];
    check_given(op, names[k], t);
    PC_ARG(t.is_cpu(), op, names[k], " must be a CPU (host) tensor, got one on ", device_str(t));
    check_dim(op, names[k], t, 1);
    check_dtype(op, names[k], t, {ST::Long, ST::Int});
    PC_ARG(t.numel() == src_rank.numel(), op, names[k], " has ", t.numel(), " entries but src_rank has ",
           src_rank.numel(), " (one entry per move)");
    v[k] = host_ints(t);
  }
  std::vector<exchange::Move> moves(v[0].size());
  for (size_t i = 0; i < moves.size(); ++i) moves[i] = exchange::Move{v[0][i], v[1][i], v[2][i], v[3][i]};
  return schedule_tensors(exchange::build_schedule(op, cp_size, cp_rank, n_src, n_out, std::move(moves)));
}

bool exchange_nccl_available() { return exchange::nccl_available(); }

Tensor exchange_nccl_unique_id() {
  Tensor id = torch::stable::empty({128}, ST::Byte, std::nullopt, Device(torch::headeronly::DeviceType::CPU));
  exchange::nccl_unique_id(static_cast<uint8_t*>(id.mutable_data_ptr()));
  return id;
}

// Communicators made by exchange_nccl_comm_init: a prepared move only takes one of these (an arbitrary integer
// would be dereferenced by NCCL). Never destroyed, like the registry of prepared moves below: the two
// registries are the torch layer's only state, kept so that nothing runs at process exit.
std::mutex& comm_mutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::set<int64_t>& comms() {
  static auto* s = new std::set<int64_t>();
  return *s;
}

int64_t exchange_nccl_comm_init(Tensor unique_id, int64_t nranks, int64_t rank, int64_t device_index) {
  const char* op = "exchange_nccl_comm_init";
  check_given(op, "unique_id", unique_id);
  PC_ARG(unique_id.is_cpu() && unique_id.scalar_type() == ST::Byte && unique_id.numel() == 128, op,
         "unique_id must be a CPU uint8 tensor of 128 bytes, got ", dtype_name(unique_id.scalar_type()), " ",
         shape_str(unique_id), " on ", device_str(unique_id));
  PC_ARG(nranks >= 1 && nranks <= INT_MAX, op, "nranks must be in [1, ", INT_MAX, "], got ", nranks);
  PC_ARG(rank >= 0 && rank < nranks, op, "rank ", rank, " is not in [0, nranks=", nranks, ")");
  PC_ARG(device_index >= 0 && device_index <= INT32_MAX, op, "device_index must be a CUDA device index >= 0, got ",
         device_index);
  if (!exchange::nccl_available())
    throw std::runtime_error("packcuda.exchange_nccl_comm_init: packcuda was built without NCCL (nccl.h not found)");
  unique_id = dense(unique_id);
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  try {
    guard.emplace(static_cast<int32_t>(device_index));
  } catch (const std::exception& e) {
    PC_ARG(false, op, "device_index=", device_index, " is not a usable CUDA device (", e.what(), ")");
  }
  const int64_t comm = reinterpret_cast<int64_t>(exchange::nccl_comm_init(
      static_cast<const uint8_t*>(unique_id.const_data_ptr()), static_cast<int>(nranks), static_cast<int>(rank)));
  std::lock_guard<std::mutex> lock(comm_mutex());
  comms().insert(comm);
  return comm;
}

// Prepared moves: one direction of a cached schedule on the device (index tensors, counts, communicator, output
// shape), kept here so that a call passes one tensor and one handle: the per-call host path is the argument
// check, two allocations, the kernels and the NCCL group. Handles live until released (the Python call object
// releases its own); the registry itself is never destroyed, so nothing runs at process exit.
struct Prepared {
  Tensor send_index, unpack;
  std::vector<int64_t> send_counts, recv_counts, send_first, out_lead;
  int64_t n_src = 0, n_send = 0, n_recv = 0, comm = 0, rank = 0;
  bool direct = false;
};

std::mutex& prepared_mutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::vector<std::shared_ptr<const Prepared>>& prepared() {
  static auto* v = new std::vector<std::shared_ptr<const Prepared>>();
  return *v;
}

// Every argument is checked (lists, counts, sizes, tensors, then the communicator) before anything is kept.
// The index values live on the device and are not read here (no sync): send_index must hold rows in
// [0, n_src) and unpack_index values in [-1, n_src + sum(recv_counts)), as a Schedule's lists do.
int64_t exchange_prepare(Tensor send_index, std::vector<int64_t> send_counts, std::vector<int64_t> recv_counts,
                         std::vector<int64_t> send_first, Tensor unpack_index, int64_t comm, int64_t rank,
                         int64_t n_src, std::vector<int64_t> out_lead) {
  const char* op = "exchange_prepare";
  check_given(op, "send_index", send_index);
  check_given(op, "unpack_index", unpack_index);
  const int64_t cp = static_cast<int64_t>(send_counts.size());
  PC_ARG(cp >= 1, op, "send_counts must have one entry per rank (cp >= 1), got an empty list");
  PC_ARG(static_cast<int64_t>(recv_counts.size()) == cp && static_cast<int64_t>(send_first.size()) == cp, op,
         "send_counts, recv_counts and send_first must have cp entries each, got ", cp, ", ", recv_counts.size(), ", ",
         send_first.size());
  PC_ARG(rank >= 0 && rank < cp, op, "rank ", rank, " is not in [0, cp=", cp, ")");
  PC_ARG(n_src >= 0, op, "n_src must be >= 0, got ", n_src);
  auto e = std::make_shared<Prepared>();
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
  PC_ARG(send_index.numel() == e->n_send, op, "send_index has ", send_index.numel(), " entries but send_counts sum to ",
         e->n_send);
  PC_ARG(lead == unpack_index.size(0), op, "out_lead ", out_lead.size(), " dims hold ", lead,
         " rows but unpack_index has ", unpack_index.size(0));
  PC_ARG(unpack_index.size(1) <= INT_MAX, op, "unpack_index may hold at most ", INT_MAX, " sources per row, got ",
         unpack_index.size(1));
  check_same_device(op, "unpack_index", unpack_index, "send_index", send_index);
  PC_ARG(send_index.is_cuda(), op, "send_index must be a CUDA tensor, got ", device_str(send_index));
  {
    std::lock_guard<std::mutex> lock(comm_mutex());
    PC_ARG(comms().count(comm) == 1, op, "comm=", comm, " is not a communicator from exchange_nccl_comm_init");
  }
  e->send_index = dense(send_index);
  e->unpack = dense(unpack_index);
  e->direct = exchange::sends_direct(send_counts.data(), send_first.data(), cp, rank);
  e->send_counts = std::move(send_counts);
  e->recv_counts = std::move(recv_counts);
  e->send_first = std::move(send_first);
  e->out_lead = std::move(out_lead);
  e->n_src = n_src;
  e->comm = comm;
  e->rank = rank;
  std::lock_guard<std::mutex> lock(prepared_mutex());
  prepared().push_back(std::move(e));
  return static_cast<int64_t>(prepared().size());
}

// The prepared move of a live handle (kept alive by the returned pointer even if it is released meanwhile).
std::shared_ptr<const Prepared> prepared_of(const char* op, int64_t handle) {
  std::lock_guard<std::mutex> lock(prepared_mutex());
  auto& v = prepared();
  PC_ARG(handle >= 1 && handle <= static_cast<int64_t>(v.size()) && v[handle - 1], op, "unknown or released handle ",
         handle);
  return v[handle - 1];
}

// Releasing a released handle again is a no-op; a handle that was never issued is refused.
void exchange_release(int64_t handle) {
  std::lock_guard<std::mutex> lock(prepared_mutex());
  auto& v = prepared();
  PC_ARG(handle >= 1 && handle <= static_cast<int64_t>(v.size()), "exchange_release", "unknown handle ", handle,
         " (handles come from exchange_prepare)");
  v[handle - 1].reset();
}

// Runs a prepared move on src [n_src, C] (or any [..., C] holding n_src rows); returns [*out_lead, C].
// out_lead is the prepared one, passed again so that the fake kernel has the output shape from the arguments.
Tensor exchange_run(Tensor src, int64_t handle, std::vector<int64_t> out_lead) {
  const char* op = "exchange_run";
  const std::shared_ptr<const Prepared> ep = prepared_of(op, handle);
  const Prepared& e = *ep;
  check_given(op, "src", src);
  PC_ARG(src.is_cuda(), op, "src must be a CUDA tensor, got ", device_str(src));
  PC_ARG(src.dim() >= 2, op, "src must be [rows, C] (or [..., C]), got ", shape_str(src));
  const int64_t M = e.unpack.size(1);
  check_rows_dtype(op, "src", src, M);
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
  run_kernel(
      src, [] {},
      [&](auto stream) {
        char* base = static_cast<char*>(staging.mutable_data_ptr());
        exchange::ExchangeArgs a;
        a.src = src.const_data_ptr();
        a.n_src = e.n_src;
        a.send_index = e.send_index.const_data_ptr<int64_t>();
        a.send_counts = e.send_counts.data();
        a.recv_counts = e.recv_counts.data();
        a.send_first = e.send_first.data();
        a.unpack = e.unpack.const_data_ptr<int64_t>();
        a.M = static_cast<int>(M);
        a.out = out.mutable_data_ptr();
        a.n_out = e.unpack.size(0);
        a.C = C;
        a.elem_size = static_cast<int>(element_size(src.scalar_type()));
        a.dtype = core_dtype(src.scalar_type());
        a.send_buf = e.direct ? nullptr : base;
        a.recv_buf = base + (e.direct ? 0 : e.n_send * C * a.elem_size);
        a.cp = static_cast<int64_t>(e.send_counts.size());
        a.rank = e.rank;
        exchange::exchange_rows_nccl(a, reinterpret_cast<ncclComm_t>(e.comm), stream);
      });
  return out;
}

}  // namespace

std::vector<Tensor> schedule_tensors(const exchange::Schedule& sc) {
  Tensor bwd_unpack = torch::stable::reshape(host_i64(sc.bwd_unpack), {sc.n_src, sc.bwd_m});
  return {host_i64(sc.send_index),
          host_i64(sc.send_counts),
          host_i64(sc.recv_counts),
          host_i64(sc.unpack),
          host_i64(sc.bwd_send_index),
          bwd_unpack,
          host_i64({sc.cp, sc.rank, sc.n_src, sc.n_out}),
          host_i64(sc.send_first),
          host_i64(sc.bwd_send_first)};
}

void check_schedule_cp(const char* op, const char* name, int64_t cp_size) {
  PC_ARG(cp_size <= exchange::kMaxCp, op, name, " must be <= ", exchange::kMaxCp,
         " (a schedule keeps lists for every peer), got ", cp_size);
}

}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def("exchange_gather_sum(Tensor a, Tensor b, Tensor index) -> Tensor");
  m.def(
      "exchange_schedule(int cp_size, int cp_rank, int n_src, int n_out, Tensor src_rank, Tensor src_row, "
      "Tensor dst_rank, Tensor dst_slot) -> Tensor[]");
  m.def("exchange_nccl_available() -> bool");
  m.def("exchange_nccl_unique_id() -> Tensor");
  m.def("exchange_nccl_comm_init(Tensor unique_id, int nranks, int rank, int device_index) -> int");
  m.def(
      "exchange_prepare(Tensor send_index, int[] send_counts, int[] recv_counts, int[] send_first, "
      "Tensor unpack_index, int comm, int rank, int n_src, int[] out_lead) -> int");
  m.def("exchange_run(Tensor src, int handle, int[] out_lead) -> Tensor");
  m.def("exchange_release(int handle) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(packcuda, CompositeExplicitAutograd, m) {
  PC_IMPL(m, "exchange_nccl_available", &packcuda::th::exchange_nccl_available);
  PC_IMPL(m, "exchange_nccl_unique_id", &packcuda::th::exchange_nccl_unique_id);
  PC_IMPL(m, "exchange_nccl_comm_init", &packcuda::th::exchange_nccl_comm_init);
  PC_IMPL(m, "exchange_prepare", &packcuda::th::exchange_prepare);
  PC_IMPL(m, "exchange_release", &packcuda::th::exchange_release);
}

// exchange_schedule takes host move lists (its CUDA registration only answers device tensors with a clear error);
// exchange_run is registered on CPU only to refuse a CPU src by name (the move runs on CUDA).
#define PC_EXCHANGE_IMPLS(m)                                             \
  PC_IMPL(m, "exchange_gather_sum", &packcuda::th::exchange_gather_sum); \
  PC_IMPL(m, "exchange_schedule", &packcuda::th::exchange_schedule);     \
  PC_IMPL(m, "exchange_run", &packcuda::th::exchange_run);

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) {PC_EXCHANGE_IMPLS(m)}
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) {
  PC_EXCHANGE_IMPLS(m)
}
#endif
