// Torch layer of the packing ops: schemas, argument checks, dispatch to the core kernels.
#include <cstring>

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include "common/torch/checks.h"
#include "pack/pack.h"

namespace packcuda::th {
namespace {

using torch::stable::Device;

// A tensor seen as [lead, n, row] along dim `dim`: the dims after `dim` are dense rows of row_bytes bytes, n
// rows follow each other, and the dims before `dim` collapse into one lead dimension of stride lead_bytes.
struct RowView {
  int64_t lead = 1, n = 0, row_bytes = 0, lead_bytes = 0;
};

// False when the strides do not allow that view without a copy.
bool row_view(const Tensor& t, int64_t dim, RowView& v) {
  const auto sz = t.sizes();
  const auto st = t.strides();
  const int64_t nd = static_cast<int64_t>(sz.size());
  const int64_t esz = element_size(t.scalar_type());
  int64_t inner = 1;
  for (int64_t k = nd - 1; k > dim; --k) {
    if (sz[k] != 1 && st[k] != inner) return false;
    inner *= sz[k];
  }
  v.n = sz[dim];
  if (v.n > 1 && st[dim] != inner) return false;
  v.row_bytes = inner * esz;
  v.lead = 1;
  int64_t lead_stride = v.n * inner, expect = 0;
  bool first = true;
  for (int64_t k = dim - 1; k >= 0; --k) {
    if (sz[k] == 1) continue;
    if (first) {
      lead_stride = st[k];
      first = false;
    } else if (st[k] != expect) {
      return false;
    }
    expect = st[k] * sz[k];
    v.lead *= sz[k];
  }
  v.lead_bytes = lead_stride * esz;
  return true;
}

int64_t normalize_dim(const char* op, const char* name, const Tensor& t, int64_t dim) {
  const int64_t nd = t.dim();
  PC_ARG(nd >= 1, op, name, " must have at least 1 dimension");
  PC_ARG(dim >= -nd && dim < nd, op, "dim=", dim, " is out of range for ", name, " of shape ", shape_str(t));
  return dim < 0 ? dim + nd : dim;
}

// The index of a row op: int64, 1-D, on src's device, contiguous.
Tensor checked_index(const char* op, const Tensor& src, Tensor index) {
  check_dtype(op, "index", index, {ST::Long});
  check_dim(op, "index", index, 1);
  check_same_device(op, "index", index, "src", src);
  return dense(index);
}

// Shape of src with dim `dim` resized to n.
std::vector<int64_t> resized(const Tensor& src, int64_t dim, int64_t n) {
  const auto sz = src.sizes();
  std::vector<int64_t> shape(sz.begin(), sz.end());
  shape[dim] = n;
  return shape;
}

// src along dim as [lead, n, row] (copying src only when its strides do not allow it).
RowView rows_of(Tensor& src, int64_t dim) {
  RowView v;
  if (!row_view(src, dim, v)) {
    src = torch::stable::contiguous(src);
    row_view(src, dim, v);
  }
  return v;
}

Tensor gather_rows(Tensor src, Tensor index, double fill, int64_t dim) {
  const char* op = "gather_rows";
  dim = normalize_dim(op, "src", src, dim);
  index = checked_index(op, src, index);
  check_row_dtype(op, "src", src);
  const RowView v = rows_of(src, dim);
  if (src.is_cpu()) check_index_range(op, "index", index, -1, v.n, false);
  const int64_t n_out = index.numel();
  Tensor out = new_tensor(resized(src, dim, n_out), src.scalar_type(), src.device());
  if (n_out == 0 || v.lead == 0 || v.row_bytes == 0) return out;
  const int esz = static_cast<int>(element_size(src.scalar_type()));
  const uint64_t fbits = fill_bits(src.scalar_type(), fill);
  if (src.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(src);
      pack::gather_rows_cuda(out.mutable_data_ptr(), src.const_data_ptr(), index.const_data_ptr<int64_t>(), n_out,
                             v.row_bytes, fbits, esz, cs.stream, v.lead, v.lead_bytes);
    });
  } else {
    pack::gather_rows_cpu(out.mutable_data_ptr(), src.const_data_ptr(), index.const_data_ptr<int64_t>(), n_out,
                          v.row_bytes, fbits, esz, v.lead, v.lead_bytes);
  }
  return out;
}

Tensor scatter_rows(Tensor src, Tensor index, int64_t num_rows, int64_t dim) {
  const char* op = "scatter_rows";
  dim = normalize_dim(op, "src", src, dim);
  index = checked_index(op, src, index);
  check_row_dtype(op, "src", src);
  PC_ARG(index.numel() == src.size(dim), op, "index has ", index.numel(), " entries but src has ", src.size(dim),
         " rows", dim == 0 ? "" : detail::cat(" along dim ", dim));
  PC_ARG(num_rows >= 0, op, "num_rows must be >= 0, got ", num_rows);
  const RowView v = rows_of(src, dim);
  if (src.is_cpu()) check_index_range(op, "index", index, -1, num_rows, /*unique=*/true);
  Tensor out = new_tensor(resized(src, dim, num_rows), src.scalar_type(), src.device());
  if (v.lead == 0 || v.row_bytes == 0) return out;
  // Narrow rows: zero-fill then scatter (two light passes). Wide rows: invert the index (8 bytes a row) and
  // gather, so every output byte is written exactly once.
  [[maybe_unused]] const int esz = static_cast<int>(element_size(src.scalar_type()));
  [[maybe_unused]] const bool direct = v.row_bytes <= 64;
  if (src.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(src);
      if (direct) {
        pack::scatter_rows_cuda(out.mutable_data_ptr(), num_rows, src.const_data_ptr(),
                                index.const_data_ptr<int64_t>(), index.numel(), v.row_bytes, cs.stream, v.lead,
                                v.lead_bytes);
      } else {
        Tensor inv = new_tensor({num_rows}, ST::Long, index.device());
        pack::invert_index_cuda(inv.mutable_data_ptr<int64_t>(), num_rows, index.const_data_ptr<int64_t>(),
                                index.numel(), cs.stream);
        if (num_rows > 0)
          pack::gather_rows_cuda(out.mutable_data_ptr(), src.const_data_ptr(), inv.const_data_ptr<int64_t>(),
                                 num_rows, v.row_bytes, 0, esz, cs.stream, v.lead, v.lead_bytes);
      }
    });
  } else {
    pack::scatter_rows_cpu(out.mutable_data_ptr(), num_rows, src.const_data_ptr(), index.const_data_ptr<int64_t>(),
                           index.numel(), v.row_bytes, v.lead, v.lead_bytes);
  }
  return out;
}

Tensor segment_positions(Tensor cu_seqlens, int64_t total, std::optional<Device> device) {
  const char* op = "segment_positions";
  PC_ARG(total >= 0, op, "total must be >= 0, got ", total);
  const Device target = target_device(cu_seqlens, device);
  Segments seg = segments(op, "cu_seqlens", cu_seqlens, target, total);
  Tensor out = torch::stable::new_empty(seg.tensor, {total}, ST::Long);
  if (total == 0) return out;
  if (out.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(out);
      pack::segment_positions_cuda(out.mutable_data_ptr<int64_t>(), seg.ptr(), seg.count, total, cs.stream);
    });
  } else {
    pack::segment_positions_cpu(out.mutable_data_ptr<int64_t>(), seg.ptr(), seg.count, total);
  }
  return out;
}

Tensor next_token_labels(Tensor input_ids, Tensor cu_seqlens, int64_t ignore_index) {
  const char* op = "next_token_labels";
  check_dim(op, "input_ids", input_ids, 1);
  check_dtype(op, "input_ids", input_ids, {ST::Int, ST::Long});
  input_ids = torch::stable::contiguous(input_ids);
  const int64_t total = input_ids.numel();
  Segments seg = segments(op, "cu_seqlens", cu_seqlens, input_ids.device(), total);
  Tensor out = torch::stable::new_empty(input_ids, {total});
  if (total == 0) return out;
  const int esz = static_cast<int>(element_size(input_ids.scalar_type()));
  if (out.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(out);
      pack::next_token_labels_cuda(out.mutable_data_ptr(), input_ids.const_data_ptr(), esz, seg.ptr(), seg.count,
                                   total, ignore_index, cs.stream);
    });
  } else {
    pack::next_token_labels_cpu(out.mutable_data_ptr(), input_ids.const_data_ptr(), esz, seg.ptr(), seg.count,
                                total, ignore_index);
  }
  return out;
}

Tensor right_pad_indices(Tensor cu_seqlens, int64_t seqlen, int64_t total, std::optional<Device> device) {
  const char* op = "right_pad_indices";
  PC_ARG(seqlen >= 0, op, "seqlen must be >= 0, got ", seqlen);
  const Device target = target_device(cu_seqlens, device);
  Segments seg = segments(op, "cu_seqlens", cu_seqlens, target, total);
  for (int64_t i = 0; seg.on_host && i < seg.count; ++i)
    PC_ARG(seg.host[i + 1] - seg.host[i] <= seqlen, op, "length of sequence ", i, " (",
           seg.host[i + 1] - seg.host[i], ") exceeds seqlen ", seqlen);
  Tensor out = torch::stable::new_empty(seg.tensor, {total}, ST::Long);
  if (total == 0) return out;
  if (out.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(out);
      pack::right_pad_indices_cuda(out.mutable_data_ptr<int64_t>(), seg.ptr(), seg.count, seqlen, total,
                                   cs.stream);
    });
  } else {
    pack::right_pad_indices_cpu(out.mutable_data_ptr<int64_t>(), seg.ptr(), seg.count, seqlen, total);
  }
  return out;
}

Tensor mask_indices(Tensor mask, Tensor cu_seqlens, int64_t total) {
  const char* op = "mask_indices";
  check_dim(op, "attention_mask", mask, 2);
  check_dtype(op, "attention_mask", mask, {ST::Bool, ST::Byte});
  mask = torch::stable::contiguous(mask);
  Segments seg = segments(op, "cu_seqlens", cu_seqlens, mask.device(), total);
  PC_ARG(seg.count == mask.size(0), op, "cu_seqlens has ", seg.count, " segments but attention_mask has ",
         mask.size(0), " rows");
  Tensor out = torch::stable::new_empty(seg.tensor, {total}, ST::Long);
  if (total == 0) return out;
  const auto* m = static_cast<const uint8_t*>(mask.const_data_ptr());
  if (out.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(out);
      pack::mask_indices_cuda(out.mutable_data_ptr<int64_t>(), m, mask.size(0), mask.size(1), seg.ptr(),
                              cs.stream);
    });
  } else {
    // On the host the counts are checked against the mask before anything is written.
    for (int64_t r = 0; r < mask.size(0); ++r) {
      int64_t c = 0;
      for (int64_t j = 0; j < mask.size(1); ++j) c += m[r * mask.size(1) + j] != 0;
      PC_ARG(c == seg.host[r + 1] - seg.host[r], op, "row ", r, " of attention_mask has ", c,
             " set entries but cu_seqlens gives ", seg.host[r + 1] - seg.host[r]);
    }
    pack::mask_indices_cpu(out.mutable_data_ptr<int64_t>(), m, mask.size(0), mask.size(1), seg.ptr());
  }
  return out;
}

}  // namespace
}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def("gather_rows(Tensor src, Tensor index, float fill=0., int dim=0) -> Tensor");
  m.def("scatter_rows(Tensor src, Tensor index, int num_rows, int dim=0) -> Tensor");
  m.def("segment_positions(Tensor cu_seqlens, int total, Device? device=None) -> Tensor");
  m.def("next_token_labels(Tensor input_ids, Tensor cu_seqlens, int ignore_index=-100) -> Tensor");
  m.def("right_pad_indices(Tensor cu_seqlens, int seqlen, int total, Device? device=None) -> Tensor");
  m.def("mask_indices(Tensor attention_mask, Tensor cu_seqlens, int total) -> Tensor");
}

#define PC_PACK_IMPLS(m)                                                    \
  m.impl("gather_rows", TORCH_BOX(&packcuda::th::gather_rows));             \
  m.impl("scatter_rows", TORCH_BOX(&packcuda::th::scatter_rows));           \
  m.impl("segment_positions", TORCH_BOX(&packcuda::th::segment_positions)); \
  m.impl("next_token_labels", TORCH_BOX(&packcuda::th::next_token_labels)); \
  m.impl("right_pad_indices", TORCH_BOX(&packcuda::th::right_pad_indices)); \
  m.impl("mask_indices", TORCH_BOX(&packcuda::th::mask_indices));

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) { PC_PACK_IMPLS(m) }
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) { PC_PACK_IMPLS(m) }
#endif
