// Torch layer of the shard-plan ops: schemas, argument checks, dispatch to the core functions.
//  - shard_plan: the whole plan of one rank in one call (layout on the host, one packed upload, one launch);
//  - shard_unshard_index: each original row's row in the rank-major concatenation of all local buffers.
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>

#include "common/checked.h"
#include "common/torch/checks.h"
#include "shard/shard.h"
#include "shard/torch/shard_args.h"

namespace packcuda::th {
namespace {

using torch::stable::Device;

constexpr int64_t kMax = shard::kMaxPaddedTotal;

void check_cp_size(const char* op, int64_t cp_size) {
  PC_ARG(cp_size >= 1, op, "cp_size must be >= 1, got ", cp_size);
  PC_ARG(cp_size <= kMax, op, "cp_size must be <= ", kMax, " (the plan's boundaries are int32), got ", cp_size);
}

// total_local (rows of one rank's local buffer): in [0, kMaxPaddedTotal].
void check_total_local(const char* op, int64_t total_local) {
  PC_ARG(total_local >= 0 && total_local <= kMax, op, "total_local must be in [0, ", kMax, "], got ", total_local);
}

}  // namespace

Layout parse_layout(const char* op, const char* name, const std::string& value) {
  PC_ARG(value == "zigzag" || value == "contiguous", op, name, " must be 'zigzag' or 'contiguous', got '", value, "'");
  return value == "zigzag" ? Layout::Zigzag : Layout::Contiguous;
}

std::vector<int64_t> checked_layout_args(const char* op, const Tensor& cu_seqlens, int64_t cp_size, int64_t cp_rank,
                                         Layout layout, int64_t align, std::optional<int64_t> bucket_opt) {
  check_cp_size(op, cp_size);
  PC_ARG(cp_rank >= 0 && cp_rank < cp_size, op, "cp_rank must be in [0, cp_size=", cp_size, "), got ", cp_rank);
  PC_ARG(align >= 1, op, "align must be >= 1, got ", align);
  PC_ARG(align <= kMax, op, "align must be <= ", kMax, " (the plan's boundaries are int32), got ", align);
  PC_ARG(!bucket_opt || *bucket_opt >= 1, op, "bucket must be >= 1, got ", bucket_opt.value_or(0));
  PC_ARG(!bucket_opt || *bucket_opt <= kMax, op, "bucket must be <= ", kMax, " (the plan's boundaries are int32), got ",
         bucket_opt.value_or(0));
  const int64_t bucket = bucket_opt.value_or(0);
  if (layout == Layout::Zigzag) {
    // 2 * cp_size <= 2 * kMax: no overflow
    PC_ARG(align % (2 * cp_size) == 0, op, "zigzag align must be a multiple of 2*cp_size=", 2 * cp_size, ", got ",
           align);
    PC_ARG(!bucket_opt || bucket % align == 0, op, "zigzag bucket must be a multiple of align=", align, ", got ",
           bucket);
  }
  PC_ARG(cu_seqlens.is_cpu(), op, "cu_seqlens must be host metadata (a CPU tensor), got a tensor on ",
         device_str(cu_seqlens));
  check_dim(op, "cu_seqlens", cu_seqlens, 1);
  check_dtype(op, "cu_seqlens", cu_seqlens, {ST::Int, ST::Long});
  PC_ARG(cu_seqlens.numel() >= 1, op, "cu_seqlens must have at least one entry (it starts with 0)");
  std::vector<int64_t> cu = read_host_segments(op, "cu_seqlens", cu_seqlens, -1);
  const int64_t nseq = static_cast<int64_t>(cu.size()) - 1;
  // Padded sizes stay within int32 (the plan's boundary tensors are int32, as attention kernels expect): every
  // size of the layout is at most its padded total, computed here with checked arithmetic.
  const int64_t unit = bucket > 0 ? bucket : 1;
  shard::checked_padded_total(op, cu.data(), nseq, cp_size, layout_code(layout), align, unit);
  return cu;
}

namespace {

// Host cu_seqlens and the layout of one rank, after every argument check (shard_plan).
struct CheckedLayout {
  std::vector<int64_t> cu;
  shard::HostLayout h;
};

CheckedLayout checked_layout(const char* op, const Tensor& cu_seqlens, int64_t cp_size, int64_t cp_rank, Layout layout,
                             int64_t align, std::optional<int64_t> bucket_opt) {
  CheckedLayout out;
  out.cu = checked_layout_args(op, cu_seqlens, cp_size, cp_rank, layout, align, bucket_opt);
  const int64_t nseq = static_cast<int64_t>(out.cu.size()) - 1;
  out.h =
      shard::build_layout(out.cu.data(), nseq, cp_size, cp_rank, layout_code(layout), align, bucket_opt.value_or(1));
  return out;
}

// The per-slot table job of one plan (shard_plan and static_shard_plan): int32 layout inputs, int64 outputs.
shard::PlanTables plan_tables(const int32_t* cu, int64_t nseq, const int32_t* pieces, const int32_t* piece_offset,
                              const int32_t* piece_seq, int64_t npieces, int64_t total_local, Tensor& index,
                              Tensor& position, Tensor& label, Tensor& piece_offset_wide) {
  shard::PlanTables t;
  t.cu = cu;
  t.nseq = nseq;
  t.pieces = pieces;
  t.piece_offset = piece_offset;
  t.piece_seq = piece_seq;
  t.npieces = npieces;
  t.total_local = total_local;
  t.index = index.mutable_data_ptr<int64_t>();
  t.position = position.mutable_data_ptr<int64_t>();
  t.label_index = label.mutable_data_ptr<int64_t>();
  t.piece_offset_wide = piece_offset_wide.mutable_data_ptr<int64_t>();
  return t;
}

// shard_plan's host outputs, named once here (shard_plan_fields hands the names to Python, which reads them by
// name). The int32 host buffer is the sections back to back in this order; the first PlanTables::kCopies are
// also copied into the plan's own boundary tensors. info holds the scalars, then the start of every section and
// the buffer's end.
enum PlanSection : int { kSecCuPadded, kSecCuLocal, kSecPieces, kSecPieceSeq, kSecPieceOffset, kSecCu, kSections };
constexpr const char* kSectionNames[kSections] = {"cu_seqlens_padded", "cu_seqlens_local", "pieces",
                                                  "piece_seq",         "piece_offset",     "cu_seqlens"};
enum PlanScalar : int {
  kInfoTotal,
  kInfoTotalPadded,
  kInfoTotalLocal,
  kInfoPadSize,
  kInfoMaxPadded,
  kInfoMaxLocal,
  kScalars
};
constexpr const char* kScalarNames[kScalars] = {"total",    "total_padded",      "total_local",
                                                "pad_size", "max_seqlen_padded", "max_seqlen_local"};
constexpr int64_t kInfoCount = kScalars + kSections + 1;
static_assert(shard::PlanTables::kCopies == kSecPieceSeq + 1, "the copied sections come first");

// The names of the plans' host-visible fields, for Python (packcuda/shard.py): "info: <shard_plan's scalars>;
// sections: <shard_plan's host buffer sections>; status: <a static plan's status entries>; flags: <its status
// flags, bit k = 1 << k>".
std::string shard_plan_fields() {
  std::string out;
  const auto list = [&out](const char* key, const auto& names) {
    out = out + (out.empty() ? "" : "; ") + key + ":";
    for (const char* n : names) out = out + " " + n;
  };
  list("info", kScalarNames);
  list("sections", kSectionNames);
  list("status", shard::kStaticStatusNames);
  list("flags", shard::kStaticStatusFlagNames);
  return out;
}

// The whole plan of one rank in one call: the layout on the host, every boundary array packed into one int32
// host buffer (pinned for a CUDA target) and uploaded with one non-blocking copy, then one kernel launch that
// writes the per-slot tables and the plan's own boundary tensors from that upload. Returns
//   index, position, label_index  int64 [total_local]   (target device)
//   cu_seqlens_padded             int32 [nseg+1]        (target device)
//   cu_seqlens_local              int32 [nseg+1]        (target device)
//   pieces                        int32 [S+1]           (target device)
//   piece_offset                  int64 [S]             (target device)
//   piece_seq                     int32 [S]             (target device)
//   host_meta                     int32 [M]             (CPU) the sections (PlanSection), the host copy of
//                                                        the upload
//   info                          int64 [kInfoCount]    (CPU) the scalars (PlanScalar), then the section starts
//                                                        and M
// Every output is its own tensor (none aliases another). No device sync.
using PlanOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

PlanOutputs shard_plan(Tensor cu_seqlens, int64_t cp_size, int64_t cp_rank, std::string layout_str, int64_t align,
                       std::optional<int64_t> bucket_opt, std::optional<Device> device) {
  const char* op = "shard_plan";
  const Layout layout = parse_layout(op, "layout", layout_str);
  const Device target = target_device(op, cu_seqlens, device);
  const CheckedLayout c = checked_layout(op, cu_seqlens, cp_size, cp_rank, layout, align, bucket_opt);
  const shard::HostLayout& h = c.h;
  const int64_t nseq = static_cast<int64_t>(c.cu.size()) - 1;
  const int64_t nseg = static_cast<int64_t>(h.cu_padded.size()) - 1;
  const int64_t np = static_cast<int64_t>(h.piece_offset.size());
  const bool on_cpu = target.type() == torch::headeronly::DeviceType::CPU;
  const Device cpu(torch::headeronly::DeviceType::CPU);

  // One int32 host buffer (every value is at most total_padded, which checked_layout keeps within int32).
  const std::vector<int64_t>* section[kSections] = {};
  section[kSecCuPadded] = &h.cu_padded;
  section[kSecCuLocal] = &h.cu_local;
  section[kSecPieces] = &h.pieces;
  section[kSecPieceSeq] = &h.piece_seq;
  section[kSecPieceOffset] = &h.piece_offset;
  section[kSecCu] = &c.cu;
  int64_t offs[kSections + 1];
  offs[0] = 0;
  for (int k = 0; k < kSections; ++k) offs[k + 1] = offs[k] + static_cast<int64_t>(section[k]->size());
  const int64_t n_meta = offs[kSections];
  Tensor host_meta = new_tensor({n_meta}, ST::Int, cpu, /*pinned=*/!on_cpu);
  int32_t* m = host_meta.mutable_data_ptr<int32_t>();
  for (const std::vector<int64_t>* v : section)
    for (int64_t x : *v) *m++ = static_cast<int32_t>(x);
  // ... uploaded with one non-blocking copy (the pinned buffer stays with the plan as its host copy)
  const int32_t* base = host_meta.const_data_ptr<int32_t>();
  Tensor meta;
  if (!on_cpu) {
    meta = new_tensor({n_meta}, ST::Int, target);
    copy_into(meta, host_meta, /*non_blocking=*/true);
    base = meta.const_data_ptr<int32_t>();
  }

  int64_t max_local = 0;
  for (int64_t i = 0; i < nseg; ++i) max_local = std::max(max_local, h.cu_local[i + 1] - h.cu_local[i]);
  Tensor info = new_tensor({kInfoCount}, ST::Long, cpu);
  int64_t* vals = info.mutable_data_ptr<int64_t>();
  vals[kInfoTotal] = h.total;
  vals[kInfoTotalPadded] = h.total_padded;
  vals[kInfoTotalLocal] = h.total_local;
  vals[kInfoPadSize] = h.pad_size;
  vals[kInfoMaxPadded] = h.max_seqlen_padded;
  vals[kInfoMaxLocal] = max_local;
  std::copy(offs, offs + kSections + 1, vals + kScalars);

  Tensor index = new_tensor({h.total_local}, ST::Long, target);
  Tensor position = new_tensor({h.total_local}, ST::Long, target);
  Tensor label = new_tensor({h.total_local}, ST::Long, target);
  const auto section_tensor = [&](int k) { return new_tensor({offs[k + 1] - offs[k]}, ST::Int, target); };
  Tensor cu_padded = section_tensor(kSecCuPadded);
  Tensor cu_local = section_tensor(kSecCuLocal);
  Tensor pieces = section_tensor(kSecPieces);
  Tensor piece_seq = section_tensor(kSecPieceSeq);
  Tensor piece_offset = new_tensor({np}, ST::Long, target);

  shard::PlanTables t = plan_tables(base + offs[kSecCu], nseq, base + offs[kSecPieces], base + offs[kSecPieceOffset],
                                    base + offs[kSecPieceSeq], np, h.total_local, index, position, label, piece_offset);
  Tensor* copies[shard::PlanTables::kCopies] = {};
  copies[kSecCuPadded] = &cu_padded;
  copies[kSecCuLocal] = &cu_local;
  copies[kSecPieces] = &pieces;
  copies[kSecPieceSeq] = &piece_seq;
  for (int k = 0; k < shard::PlanTables::kCopies; ++k) {
    t.copy_dst[k] = copies[k]->mutable_data_ptr<int32_t>();
    t.copy_src[k] = base + offs[k];
    t.copy_n[k] = offs[k + 1] - offs[k];
  }
  run_kernel(index, [&] { shard::plan_tables_cpu(t); }, [&](auto stream) { shard::plan_tables_cuda(t, stream); });
  return {index, position, label, cu_padded, cu_local, pieces, piece_offset, piece_seq, host_meta, info};
}

Tensor shard_unshard_index(Tensor cu_seqlens, Tensor cu_seqlens_padded, int64_t cp_size, std::string layout_str,
                           int64_t total_local, std::optional<Device> device) {
  const char* op = "shard_unshard_index";
  const Layout layout = parse_layout(op, "layout", layout_str);
  check_cp_size(op, cp_size);
  check_total_local(op, total_local);
  // rows of the rank-major concatenation of all local buffers (the plan's padded total)
  const int64_t concat = checked::mul(op, "cp_size * total_local", cp_size, total_local);
  PC_ARG(concat <= kMax, op, "cp_size * total_local = ", concat, " does not fit int32 boundaries (at most ", kMax, ")");
  const Device target = target_device(op, cu_seqlens, device);
  PC_ARG(cu_seqlens.is_cpu(), op, "cu_seqlens must be host metadata (a CPU tensor), got a tensor on ",
         device_str(cu_seqlens));
  PC_ARG(cu_seqlens_padded.is_cpu(), op, "cu_seqlens_padded must be host metadata (a CPU tensor), got a tensor on ",
         device_str(cu_seqlens_padded));
  Segments cu = segments(op, "cu_seqlens", cu_seqlens, target, -1);
  Segments cp = segments(op, "cu_seqlens_padded", cu_seqlens_padded, target, concat);
  const int64_t nseq = cu.count;
  PC_ARG(cp.count == nseq || cp.count == nseq + 1, op, "cu_seqlens_padded must have ", nseq + 1, " or ", nseq + 2,
         " entries (one more with a bucket segment), got ", cp.count + 1);
  for (int64_t i = 0; i < cp.count; ++i) {
    const int64_t p = cp.host[i + 1] - cp.host[i];
    const int64_t len = i < nseq ? cu.host[i + 1] - cu.host[i] : 0;
    PC_ARG(p >= len, op, "padded segment ", i, " has ", p, " rows, fewer than its ", len, " tokens");
    if (layout == Layout::Zigzag)
      PC_ARG(p % (2 * cp_size) == 0, op, "zigzag padded segment ", i, " has ", p,
             " rows, not a multiple of 2*cp_size=", 2 * cp_size);
  }
  const int64_t total = cu.host.back();
  Tensor out = new_tensor({total}, ST::Long, target);
  if (total == 0) return out;
  run_kernel(
      out,
      [&] {
        shard::unshard_index_cpu(out.mutable_data_ptr<int64_t>(), total, cu.ptr(), nseq, cp.ptr(), cp_size,
                                 layout_code(layout), total_local);
      },
      [&](auto stream) {
        shard::unshard_index_cuda(out.mutable_data_ptr<int64_t>(), total, cu.ptr(), nseq, cp.ptr(), cp_size,
                                  layout_code(layout), total_local, stream);
      });
  return out;
}

// ---- static plans -----------------------------------------------------------------------------------------
// Shapes fixed by (capacity, max_seqs, cp_size); values only on the device (no host read, no value-dependent
// allocation: capturable in a CUDA graph). See shard_math.h "static plans".

constexpr int64_t kMaxStaticSeqs = kMax / 2 - 1;  // 2 * (max_seqs + 1) pieces fit int32 tables

// A 1-D int tensor of `len` entries of an allowed dtype on ref's device (its values stay on the device).
void check_static_table(const char* op, const char* name, const Tensor& t, std::initializer_list<ST> dtypes,
                        int64_t len, const char* len_what, const Tensor& ref, const char* ref_name) {
  check_dim(op, name, t, 1);
  check_dtype(op, name, t, dtypes);
  PC_ARG(t.numel() == len, op, name, " must have ", len_what, " = ", len, " entries, got ", t.numel());
  if (&t != &ref) check_same_device(op, name, t, ref_name, ref);
  check_device_kind(op, name, t.device());
}

// cp_size, cp_rank, layout, align and capacity of a static plan (the rules of shard_plan with bucket = capacity:
// zigzag: align % (2*cp_size) == 0, capacity % align == 0; contiguous: capacity % cp_size == 0).
void check_static_args(const char* op, int64_t cp_size, int64_t cp_rank, Layout layout, int64_t align,
                       int64_t capacity) {
  check_cp_size(op, cp_size);
  PC_ARG(cp_rank >= 0 && cp_rank < cp_size, op, "cp_rank must be in [0, cp_size=", cp_size, "), got ", cp_rank);
  PC_ARG(align >= 1 && align <= kMax, op, "align must be in [1, ", kMax, "], got ", align);
  PC_ARG(capacity >= 1 && capacity <= kMax, op, "capacity must be in [1, ", kMax,
         "] (the plan's boundaries are int32), got ", capacity);
  if (layout == Layout::Zigzag) {
    PC_ARG(align % (2 * cp_size) == 0, op, "zigzag align must be a multiple of 2*cp_size=", 2 * cp_size, ", got ",
           align);
    PC_ARG(capacity % align == 0, op, "zigzag capacity must be a multiple of align=", align, ", got ", capacity);
  } else {
    PC_ARG(capacity % cp_size == 0, op, "contiguous capacity must be a multiple of cp_size=", cp_size, ", got ",
           capacity);
  }
}

void check_max_seqs(const char* op, int64_t max_seqs) {
  PC_ARG(max_seqs >= 1 && max_seqs <= kMaxStaticSeqs, op, "max_seqs must be in [1, ", kMaxStaticSeqs,
         "] (its piece tables are int32), got ", max_seqs);
}

shard::IntView int_view(const Tensor& t) {
  shard::IntView v;
  if (t.scalar_type() == ST::Int) v.p32 = t.const_data_ptr<int32_t>();
  else v.p64 = t.const_data_ptr<int64_t>();
  return v;
}

// Static plan of one rank. Returns
//   index, position, label_index  int64 [capacity / cp_size]
//   cu_seqlens_padded             int32 [max_seqs + 2]   (trailing entries repeat capacity)
//   cu_seqlens_local              int32 [max_seqs + 2]
//   pieces                        int32 [S + 1]          S = 2 (max_seqs + 1) zigzag, max_seqs + 1 contiguous
//   piece_offset                  int64 [S]
//   piece_seq                     int32 [S]
//   cu_seqlens                    int32 [max_seqs + 1]   cu_seqlens[min(i, num_seqs)] (all 0 when refused)
//   status                        int64 [4]              flags, num_seqs, padded total, first bad cu entry
// all on cu_seqlens's device. Two launches on CUDA (layout, then per-slot tables), no sync.
using StaticOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

StaticOutputs static_shard_plan(Tensor cu_seqlens, std::optional<Tensor> num_seqs, int64_t num_seqs_host,
                                int64_t cp_size, int64_t cp_rank, std::string layout_str, int64_t align,
                                int64_t capacity, int64_t max_seqs) {
  const char* op = "static_shard_plan";
  const Layout layout = parse_layout(op, "layout", layout_str);
  check_static_args(op, cp_size, cp_rank, layout, align, capacity);
  check_max_seqs(op, max_seqs);
  check_static_table(op, "cu_seqlens", cu_seqlens, {ST::Int, ST::Long}, max_seqs + 1, "max_seqs + 1", cu_seqlens,
                     "cu_seqlens");
  if (num_seqs) {
    PC_ARG(num_seqs->dim() == 0, op, "num_seqs must be a 0-dim tensor (or a host int), got shape ",
           shape_str(*num_seqs));
    check_dtype(op, "num_seqs", *num_seqs, {ST::Int, ST::Long});
    check_same_device(op, "num_seqs", *num_seqs, "cu_seqlens", cu_seqlens);
  } else {
    PC_ARG(num_seqs_host >= 0 && num_seqs_host <= max_seqs, op, "num_seqs must be in [0, max_seqs=", max_seqs,
           "], got ", num_seqs_host);
  }
  const Tensor cu = dense(cu_seqlens);
  const Device dev = cu.device();
  const int64_t nseg = shard::static_segments(max_seqs);
  const int64_t np = shard::static_pieces(layout_code(layout), max_seqs);
  shard::StaticBuild b;
  b.cu = int_view(cu);
  if (num_seqs) b.num_seqs = int_view(*num_seqs);  // 0-dim: contiguous
  b.num_seqs_host = num_seqs_host;
  b.max_seqs = max_seqs;
  b.cp = cp_size;
  b.rank = cp_rank;
  b.align = align;
  b.capacity = capacity;
  b.total_local = capacity / cp_size;
  b.npieces = np;
  b.layout = layout_code(layout);

  Tensor index = new_tensor({b.total_local}, ST::Long, dev);
  Tensor position = new_tensor({b.total_local}, ST::Long, dev);
  Tensor label = new_tensor({b.total_local}, ST::Long, dev);
  Tensor cu_padded = new_tensor({nseg + 1}, ST::Int, dev);
  Tensor cu_local = new_tensor({nseg + 1}, ST::Int, dev);
  Tensor pieces = new_tensor({np + 1}, ST::Int, dev);
  Tensor piece_offset = new_tensor({np}, ST::Long, dev);
  Tensor piece_seq = new_tensor({np}, ST::Int, dev);
  Tensor cu_clean = new_tensor({nseg}, ST::Int, dev);
  Tensor status = new_tensor({shard::kStaticStatusLen}, ST::Long, dev);
  Tensor offset32 = new_tensor({np}, ST::Int, dev);  // scratch: plan_tables reads int32 and widens it
  b.cu_clean = cu_clean.mutable_data_ptr<int32_t>();
  b.cu_padded = cu_padded.mutable_data_ptr<int32_t>();
  b.cu_local = cu_local.mutable_data_ptr<int32_t>();
  b.pieces = pieces.mutable_data_ptr<int32_t>();
  b.piece_offset = offset32.mutable_data_ptr<int32_t>();
  b.piece_seq = piece_seq.mutable_data_ptr<int32_t>();
  b.status = status.mutable_data_ptr<int64_t>();

  const shard::PlanTables t = plan_tables(b.cu_clean, max_seqs, b.pieces, b.piece_offset, b.piece_seq, np,
                                          b.total_local, index, position, label, piece_offset);
  run_kernel(
      cu,
      [&] {
        shard::static_build_cpu(b);
        shard::plan_tables_cpu(t);
      },
      [&](auto stream) {
        shard::static_build_cuda(b, stream);
        shard::plan_tables_cuda(t, stream);
      });
  return {index, position, label, cu_padded, cu_local, pieces, piece_offset, piece_seq, cu_clean, status};
}

// Row of each original token t < capacity in the rank-major concatenation of all local buffers of a static
// plan (-1 past the real tokens), from the plan's cu_seqlens [max_seqs+1] and cu_seqlens_padded [max_seqs+2].
Tensor shard_static_unshard_index(Tensor cu_seqlens, Tensor cu_seqlens_padded, int64_t cp_size, std::string layout_str,
                                  int64_t capacity) {
  const char* op = "shard_static_unshard_index";
  const Layout layout = parse_layout(op, "layout", layout_str);
  check_cp_size(op, cp_size);
  PC_ARG(capacity >= 1 && capacity <= kMax, op, "capacity must be in [1, ", kMax, "], got ", capacity);
  PC_ARG(capacity % cp_size == 0, op, "capacity must be a multiple of cp_size=", cp_size, ", got ", capacity);
  check_dim(op, "cu_seqlens", cu_seqlens, 1);
  const int64_t max_seqs = cu_seqlens.numel() - 1;
  PC_ARG(max_seqs >= 1 && max_seqs <= kMaxStaticSeqs, op,
         "cu_seqlens must have max_seqs + 1 entries with max_seqs in [1, ", kMaxStaticSeqs, "], got ",
         cu_seqlens.numel(), " entries");
  check_static_table(op, "cu_seqlens", cu_seqlens, {ST::Int}, max_seqs + 1, "max_seqs + 1", cu_seqlens, "cu_seqlens");
  check_static_table(op, "cu_seqlens_padded", cu_seqlens_padded, {ST::Int}, max_seqs + 2, "max_seqs + 2", cu_seqlens,
                     "cu_seqlens");
  const Tensor cu = dense(cu_seqlens), cp = dense(cu_seqlens_padded);
  Tensor out = new_tensor({capacity}, ST::Long, cu.device());
  const int64_t total_local = capacity / cp_size;
  run_kernel(
      out,
      [&] {
        shard::static_unshard_index_cpu(out.mutable_data_ptr<int64_t>(), capacity, cu.const_data_ptr<int32_t>(),
                                        max_seqs, cp.const_data_ptr<int32_t>(), cp_size, layout_code(layout),
                                        total_local);
      },
      [&](auto stream) {
        shard::static_unshard_index_cuda(out.mutable_data_ptr<int64_t>(), capacity, cu.const_data_ptr<int32_t>(),
                                         max_seqs, cp.const_data_ptr<int32_t>(), cp_size, layout_code(layout),
                                         total_local, stream);
      });
  return out;
}

}  // namespace

int64_t checked_static_layout(const char* op, const Tensor& cu_seqlens_padded, int64_t cp_size, int64_t cp_rank,
                              int64_t capacity) {
  check_cp_size(op, cp_size);
  PC_ARG(cp_rank >= 0 && cp_rank < cp_size, op, "cp_rank must be in [0, cp_size=", cp_size, "), got ", cp_rank);
  PC_ARG(capacity >= 1 && capacity <= kMax, op, "capacity must be in [1, ", kMax, "], got ", capacity);
  PC_ARG(capacity % cp_size == 0, op, "capacity must be a multiple of cp_size=", cp_size, ", got ", capacity);
  check_dim(op, "cu_seqlens_padded", cu_seqlens_padded, 1);
  const int64_t max_seqs = cu_seqlens_padded.numel() - 2;
  PC_ARG(max_seqs >= 1 && max_seqs <= kMaxStaticSeqs, op,
         "cu_seqlens_padded must have max_seqs + 2 entries with max_seqs in [1, ", kMaxStaticSeqs, "], got ",
         cu_seqlens_padded.numel(), " entries");
  check_static_table(op, "cu_seqlens_padded", cu_seqlens_padded, {ST::Int}, max_seqs + 2, "max_seqs + 2",
                     cu_seqlens_padded, "cu_seqlens_padded");
  return max_seqs;
}

int64_t checked_static_pieces(const char* op, const Tensor& pieces, const Tensor& piece_offset, const Tensor& piece_seq,
                              const Tensor& cu_seqlens_padded, Layout layout, int64_t max_seqs) {
  const int64_t np = shard::static_pieces(layout_code(layout), max_seqs);
  check_static_table(op, "pieces", pieces, {ST::Int}, np + 1, "the plan's piece count + 1", cu_seqlens_padded,
                     "cu_seqlens_padded");
  check_static_table(op, "piece_offset", piece_offset, {ST::Long}, np, "the plan's piece count", cu_seqlens_padded,
                     "cu_seqlens_padded");
  check_static_table(op, "piece_seq", piece_seq, {ST::Int}, np, "the plan's piece count", cu_seqlens_padded,
                     "cu_seqlens_padded");
  return np;
}

}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def(
      "shard_plan(Tensor cu_seqlens, int cp_size, int cp_rank, str layout, int align, int? bucket=None, "
      "Device? device=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("shard_plan_fields() -> str");
  m.def(
      "shard_unshard_index(Tensor cu_seqlens, Tensor cu_seqlens_padded, int cp_size, str layout, int total_local, "
      "Device? device=None) -> Tensor");
  m.def(
      "static_shard_plan(Tensor cu_seqlens, Tensor? num_seqs, int num_seqs_host, int cp_size, int cp_rank, "
      "str layout, int align, int capacity, int max_seqs) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "shard_static_unshard_index(Tensor cu_seqlens, Tensor cu_seqlens_padded, int cp_size, str layout, "
      "int capacity) -> Tensor");
}

// The host-plan ops take host metadata (their CUDA registration only answers a device tensor with a clear error);
// the static-plan ops run on the device of their inputs.
#define PC_SHARD_IMPLS(m)                                                \
  PC_IMPL(m, "shard_plan", &packcuda::th::shard_plan);                   \
  PC_IMPL(m, "shard_unshard_index", &packcuda::th::shard_unshard_index); \
  PC_IMPL(m, "static_shard_plan", &packcuda::th::static_shard_plan);     \
  PC_IMPL(m, "shard_static_unshard_index", &packcuda::th::shard_static_unshard_index);

STABLE_TORCH_LIBRARY_IMPL(packcuda, CompositeExplicitAutograd, m) { PC_IMPL(m, "shard_plan_fields", &packcuda::th::shard_plan_fields); }
STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) { PC_SHARD_IMPLS(m) }
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) { PC_SHARD_IMPLS(m) }
#endif
