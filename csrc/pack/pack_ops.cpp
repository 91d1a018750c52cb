// Torch layer of the packing ops: schemas, argument checks, dispatch to the core kernels.
#include <cstring>

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include "common/checked.h"
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

// False when the strides do not allow that view without a copy. A tensor without elements is always viewed
// (its strides are arbitrary and no byte of it is ever read): lead and row come from the sizes alone.
bool row_view(const Tensor& t, int64_t dim, RowView& v) {
  const auto sz = t.sizes();
  const auto st = t.strides();
  const int64_t nd = static_cast<int64_t>(sz.size());
  const int64_t esz = element_size(t.scalar_type());
  v.n = sz[dim];
  if (t.numel() == 0) {
    // Callers view an empty src only for a non-empty output of the same lead and row (the zero is along
    // dim), whose byte count was checked: these products fit.
    int64_t inner = 1, lead = 1;
    for (int64_t k = nd - 1; k > dim; --k) inner *= sz[k];
    for (int64_t k = dim - 1; k >= 0; --k) lead *= sz[k];
    v.lead = lead;
    v.row_bytes = inner * esz;
    v.lead_bytes = 0;
    return true;
  }
  int64_t inner = 1;
  for (int64_t k = nd - 1; k > dim; --k) {
    if (sz[k] != 1 && st[k] != inner) return false;
    inner *= sz[k];
  }
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
    if (!row_view(src, dim, v)) throw std::logic_error("packcuda: a contiguous tensor has no row view");
  }
  return v;
}

// out = a new tensor shaped like src with n rows along dim (its byte size checked; `what` names it in the
// error); false when it holds no bytes (nothing to run).
bool new_rows_out(const char* op, const char* what, const Tensor& src, int64_t dim, int64_t n, Tensor& out) {
  const std::vector<int64_t> out_shape = resized(src, dim, n);
  const int64_t out_bytes = checked_nbytes(op, what, out_shape, src.scalar_type());
  out = new_tensor(out_shape, src.scalar_type(), src.device());
  return out_bytes != 0;
}

Tensor gather_rows(Tensor src, Tensor index, double fill, int64_t dim, std::optional<int64_t> fill_int) {
  const char* op = "gather_rows";
  dim = normalize_dim(op, "src", src, dim);
  index = checked_index(op, src, index);
  check_row_dtype(op, "src", src);
  const ST dt = src.scalar_type();
  const uint64_t fbits = fill_int.has_value() ? fill_bits(op, "fill", dt, *fill_int) : fill_bits(op, "fill", dt, fill);
  const int64_t n_src = src.size(dim);
  if (src.is_cpu()) check_index_range(op, "index", index, -1, n_src, false);
  const int64_t n_out = index.numel();
  Tensor out;
  if (!new_rows_out(op, "the output size", src, dim, n_out, out)) return out;
  const RowView v = rows_of(src, dim);
  const int esz = static_cast<int>(element_size(dt));
  run_kernel(
      src,
      [&] {
        pack::gather_rows_cpu(out.mutable_data_ptr(), src.const_data_ptr(), index.const_data_ptr<int64_t>(), n_out,
                              v.row_bytes, fbits, esz, v.lead, v.lead_bytes);
      },
      [&](auto stream) {
        pack::gather_rows_cuda(out.mutable_data_ptr(), src.const_data_ptr(), index.const_data_ptr<int64_t>(), n_out,
                               v.row_bytes, fbits, esz, stream, v.lead, v.lead_bytes);
      });
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
  if (src.is_cpu()) check_index_range(op, "index", index, -1, num_rows, /*unique=*/true);
  const ST dt = src.scalar_type();
  Tensor out;
  if (!new_rows_out(op, "the output size (num_rows)", src, dim, num_rows, out)) return out;
  const RowView v = rows_of(src, dim);
  // Narrow rows: zero-fill then scatter (two light passes). Wide rows: invert the index (8 bytes a row) and
  // gather, so every output byte is written exactly once.
  [[maybe_unused]] const int esz = static_cast<int>(element_size(dt));
  [[maybe_unused]] const bool direct = v.row_bytes <= 64;
  run_kernel(
      src,
      [&] {
        pack::scatter_rows_cpu(out.mutable_data_ptr(), num_rows, src.const_data_ptr(), index.const_data_ptr<int64_t>(),
                               index.numel(), v.row_bytes, v.lead, v.lead_bytes);
      },
      [&](auto stream) {
        if (direct) {
          pack::scatter_rows_cuda(out.mutable_data_ptr(), num_rows, src.const_data_ptr(),
                                  index.const_data_ptr<int64_t>(), index.numel(), v.row_bytes, stream, v.lead,
                                  v.lead_bytes);
        } else {
          Tensor inv = new_tensor({num_rows}, ST::Long, index.device());
          pack::invert_index_cuda(inv.mutable_data_ptr<int64_t>(), num_rows, index.const_data_ptr<int64_t>(),
                                  index.numel(), stream);
          pack::gather_rows_cuda(out.mutable_data_ptr(), src.const_data_ptr(), inv.const_data_ptr<int64_t>(), num_rows,
                                 v.row_bytes, 0, esz, stream, v.lead, v.lead_bytes);
        }
      });
  return out;
}

Tensor segment_positions(Tensor cu_seqlens, int64_t total, std::optional<Device> device) {
  const char* op = "segment_positions";
  PC_ARG(total >= 0, op, "total must be >= 0, got ", total);
  const Device target = target_device(op, cu_seqlens, device);
  Segments seg = segments(op, "cu_seqlens", cu_seqlens, target, total);
  checked_nbytes(op, "total", {total}, ST::Long);
  Tensor out = new_tensor({total}, ST::Long, target);
  if (total == 0) return out;
  run_kernel(
      out, [&] { pack::segment_positions_cpu(out.mutable_data_ptr<int64_t>(), seg.ptr(), seg.count, total); },
      [&](auto stream) {
        pack::segment_positions_cuda(out.mutable_data_ptr<int64_t>(), seg.ptr(), seg.count, total, stream);
      });
  return out;
}

Tensor next_token_labels(Tensor input_ids, Tensor cu_seqlens, int64_t ignore_index) {
  const char* op = "next_token_labels";
  check_dim(op, "input_ids", input_ids, 1);
  check_dtype(op, "input_ids", input_ids, {ST::Int, ST::Long});
  int64_t lo, hi;
  int_dtype_range(input_ids.scalar_type(), lo, hi);
  PC_ARG(ignore_index >= lo && ignore_index <= hi, op, "ignore_index=", ignore_index, " is out of range for ",
         dtype_name(input_ids.scalar_type()), " input_ids [", lo, ", ", hi, "]");
  input_ids = dense(input_ids);
  const int64_t total = input_ids.numel();
  Segments seg = segments(op, "cu_seqlens", cu_seqlens, input_ids.device(), total);
  Tensor out = new_tensor({total}, input_ids.scalar_type(), input_ids.device());
  if (total == 0) return out;
  const int esz = static_cast<int>(element_size(input_ids.scalar_type()));
  run_kernel(
      out,
      [&] {
        pack::next_token_labels_cpu(out.mutable_data_ptr(), input_ids.const_data_ptr(), esz, seg.ptr(), seg.count,
                                    total, ignore_index);
      },
      [&](auto stream) {
        pack::next_token_labels_cuda(out.mutable_data_ptr(), input_ids.const_data_ptr(), esz, seg.ptr(), seg.count,
                                     total, ignore_index, stream);
      });
  return out;
}

Tensor right_pad_indices(Tensor cu_seqlens, int64_t seqlen, int64_t total, std::optional<Device> device) {
  const char* op = "right_pad_indices";
  PC_ARG(seqlen >= 0, op, "seqlen must be >= 0, got ", seqlen);
  PC_ARG(total >= 0, op, "total must be >= 0, got ", total);
  const Device target = target_device(op, cu_seqlens, device);
  Segments seg = segments(op, "cu_seqlens", cu_seqlens, target, total);
  // the flat positions b * seqlen + j must fit int64
  checked::mul(op, "batch size * seqlen", seg.count, seqlen);
  for (int64_t i = 0; seg.on_host && i < seg.count; ++i)
    PC_ARG(seg.host[i + 1] - seg.host[i] <= seqlen, op, "length of sequence ", i, " (", seg.host[i + 1] - seg.host[i],
           ") exceeds seqlen ", seqlen);
  checked_nbytes(op, "total", {total}, ST::Long);
  Tensor out = new_tensor({total}, ST::Long, target);
  if (total == 0) return out;
  run_kernel(
      out, [&] { pack::right_pad_indices_cpu(out.mutable_data_ptr<int64_t>(), seg.ptr(), seg.count, seqlen, total); },
      [&](auto stream) {
        pack::right_pad_indices_cuda(out.mutable_data_ptr<int64_t>(), seg.ptr(), seg.count, seqlen, total, stream);
      });
  return out;
}

Tensor mask_indices(Tensor mask, Tensor cu_seqlens, int64_t total) {
  const char* op = "mask_indices";
  check_dim(op, "attention_mask", mask, 2);
  check_dtype(op, "attention_mask", mask, {ST::Bool, ST::Byte});
  PC_ARG(total >= 0, op, "total must be >= 0, got ", total);
  mask = dense(mask);
  Segments seg = segments(op, "cu_seqlens", cu_seqlens, mask.device(), total);
  const int64_t rows = mask.size(0), cols = mask.size(1);
  PC_ARG(seg.count == rows, op, "cu_seqlens has ", seg.count, " segments but attention_mask has ", rows, " rows");
  const auto* m = static_cast<const uint8_t*>(mask.const_data_ptr());
  if (mask.is_cpu()) {
    // On the host the counts are checked against the mask before anything is written.
    for (int64_t r = 0; r < rows; ++r) {
      int64_t c = 0;
      for (int64_t j = 0; j < cols; ++j) c += m[r * cols + j] != 0;
      PC_ARG(c == seg.host[r + 1] - seg.host[r], op, "row ", r, " of attention_mask has ", c,
             " set entries but cu_seqlens gives ", seg.host[r + 1] - seg.host[r]);
    }
  }
  checked_nbytes(op, "total", {total}, ST::Long);
  Tensor out = new_tensor({total}, ST::Long, mask.device());
  if (total == 0) return out;
  run_kernel(
      out, [&] { pack::mask_indices_cpu(out.mutable_data_ptr<int64_t>(), m, rows, cols, seg.ptr()); },
      [&](auto stream) { pack::mask_indices_cuda(out.mutable_data_ptr<int64_t>(), m, rows, cols, seg.ptr(), stream); });
  return out;
}

}  // namespace
}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def("gather_rows(Tensor src, Tensor index, float fill=0., int dim=0, int? fill_int=None) -> Tensor");
  m.def("scatter_rows(Tensor src, Tensor index, int num_rows, int dim=0) -> Tensor");
  m.def("segment_positions(Tensor cu_seqlens, int total, Device? device=None) -> Tensor");
  m.def("next_token_labels(Tensor input_ids, Tensor cu_seqlens, int ignore_index=-100) -> Tensor");
  m.def("right_pad_indices(Tensor cu_seqlens, int seqlen, int total, Device? device=None) -> Tensor");
  m.def("mask_indices(Tensor attention_mask, Tensor cu_seqlens, int total) -> Tensor");
}

#define PC_PACK_IMPLS(m)                                             \
  PC_IMPL(m, "gather_rows", &packcuda::th::gather_rows);             \
  PC_IMPL(m, "scatter_rows", &packcuda::th::scatter_rows);           \
  PC_IMPL(m, "segment_positions", &packcuda::th::segment_positions); \
  PC_IMPL(m, "next_token_labels", &packcuda::th::next_token_labels); \
  PC_IMPL(m, "right_pad_indices", &packcuda::th::right_pad_indices); \
  PC_IMPL(m, "mask_indices", &packcuda::th::mask_indices);

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) { PC_PACK_IMPLS(m) }
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) { PC_PACK_IMPLS(m) }
#endif
