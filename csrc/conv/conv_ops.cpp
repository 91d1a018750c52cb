// Torch layer of the causal conv1d and the conv-prefix exchange: schemas, argument checks, dispatch.
#include <cstring>

#include "common/torch/checks.h"
#include "conv/conv.h"

namespace packcuda::th {
namespace {

using torch::stable::Device;
using conv::ConvArgs;
using conv::DType;

DType conv_dtype(ST t) {
  switch (t) {
    case ST::Float: return DType::F32;
    case ST::Double: return DType::F64;
    case ST::BFloat16: return DType::BF16;
    case ST::Half: return DType::F16;
    default: return DType::F32;
  }
}

struct Prepared {
  ConvArgs a;
  Tensor x, weight, cu;
  std::optional<Tensor> bias, prefix;
};

// Validates every argument of the conv (forward and backward) before anything is written.
Prepared prepare(const char* op, const Tensor& x_in, const Tensor& weight_in, const std::optional<Tensor>& bias,
                 const std::optional<Tensor>& cu_seqlens, const std::optional<Tensor>& prefix, int64_t activation) {
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
  PC_ARG(activation == 0 || activation == 1, op, "activation must be 0 (none) or 1 (silu), got ", activation);
  Prepared p;
  p.x = torch::stable::contiguous(x_in);
  p.weight = torch::stable::contiguous(weight_in);
  if (bias.has_value()) {
    const Tensor& b = *bias;
    check_same_device(op, "bias", b, "x", x_in);
    PC_ARG(b.dim() == 1 && b.size(0) == C, op, "bias must be [C] with C = ", C, ", got ", shape_str(b));
    PC_ARG(b.scalar_type() == x_in.scalar_type(), op, "bias has dtype ", dtype_name(b.scalar_type()),
           " but x has dtype ", dtype_name(x_in.scalar_type()));
    p.bias = torch::stable::contiguous(b);
  }
  int64_t nseg = 1;
  if (cu_seqlens.has_value()) {
    Segments seg = segments(op, "cu_seqlens", *cu_seqlens, x_in.device(), T);
    p.cu = seg.tensor;
    nseg = seg.count;
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
    p.prefix = torch::stable::contiguous(pf);
  }
  ConvArgs& a = p.a;
  a.x = p.x.const_data_ptr();
  a.weight = p.weight.const_data_ptr();
  a.bias = p.bias.has_value() ? p.bias->const_data_ptr() : nullptr;
  a.prefix = p.prefix.has_value() ? p.prefix->const_data_ptr() : nullptr;
  a.cu = p.cu.const_data_ptr<int64_t>();
  a.T = T;
  a.C = C;
  a.nseg = nseg;
  a.K = static_cast<int>(K);
  a.activation = static_cast<int>(activation);
  a.dtype = conv_dtype(x_in.scalar_type());
  return p;
}

Tensor causal_conv1d_fwd(Tensor x, Tensor weight, std::optional<Tensor> bias, std::optional<Tensor> cu_seqlens,
                         std::optional<Tensor> prefix, int64_t activation) {
  Prepared p = prepare("causal_conv1d", x, weight, bias, cu_seqlens, prefix, activation);
  Tensor y = torch::stable::new_empty(p.x, {p.a.T, p.a.C});
  if (p.a.T == 0 || p.a.C == 0) return y;
  if (x.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(x);
      conv::causal_conv1d_fwd_cuda(p.a, y.mutable_data_ptr(), cs.stream);
    });
  } else {
    conv::causal_conv1d_fwd_cpu(p.a, y.mutable_data_ptr());
  }
  return y;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> causal_conv1d_bwd(Tensor dy, Tensor x, Tensor weight,
                                                             std::optional<Tensor> bias,
                                                             std::optional<Tensor> cu_seqlens,
                                                             std::optional<Tensor> prefix, int64_t activation) {
  const char* op = "causal_conv1d_backward";
  Prepared p = prepare(op, x, weight, bias, cu_seqlens, prefix, activation);
  check_same_device(op, "grad_y", dy, "x", x);
  PC_ARG(dy.dim() == 2 && dy.size(0) == p.a.T && dy.size(1) == p.a.C, op, "grad_y must have the shape of x ",
         shape_str(x), ", got ", shape_str(dy));
  PC_ARG(dy.scalar_type() == x.scalar_type(), op, "grad_y has dtype ", dtype_name(dy.scalar_type()),
         " but x has dtype ", dtype_name(x.scalar_type()));
  dy = torch::stable::contiguous(dy);
  const conv::ConvArgs& a = p.a;
  Tensor dx = torch::stable::new_empty(p.x, {a.T, a.C});
  Tensor dw = torch::stable::new_empty(p.weight, {a.C, static_cast<int64_t>(a.K)});
  Tensor db = torch::stable::new_empty(p.x, {a.C});
  const int64_t S = p.prefix.has_value() ? a.nseg : 0;
  Tensor dprefix = torch::stable::new_empty(p.x, {S, static_cast<int64_t>(a.K - 1), a.C});
  const ST acc_t = a.dtype == DType::F64 ? ST::Double : ST::Float;
  if (x.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(x);
      const int64_t tiles = conv::conv_bwd_tiles_cuda(a.T, a.C);
      Tensor work = torch::stable::new_empty(p.x, {conv::conv_bwd_work_elems(tiles, a.C, a.K)}, acc_t);
      conv::causal_conv1d_bwd_cuda(a, dy.const_data_ptr(), dx.mutable_data_ptr(), dw.mutable_data_ptr(),
                                   db.mutable_data_ptr(), S ? dprefix.mutable_data_ptr() : nullptr,
                                   work.mutable_data_ptr(), tiles, cs.stream);
    });
  } else {
    const int64_t tiles = conv::conv_bwd_tiles_cpu(a.T);
    Tensor work = torch::stable::new_empty(p.x, {conv::conv_bwd_work_elems(tiles, a.C, a.K)}, acc_t);
    conv::causal_conv1d_bwd_cpu(a, dy.const_data_ptr(), dx.mutable_data_ptr(), dw.mutable_data_ptr(),
                                db.mutable_data_ptr(), S ? dprefix.mutable_data_ptr() : nullptr,
                                work.mutable_data_ptr(), tiles);
  }
  return {dx, dw, db, dprefix};
}

// out[r] = sum_m src(index[r, m]) with src(i) = a[i] for i < a.size(0), b[i - a.size(0)] above, nothing for -1.
Tensor conv_gather_sum(Tensor a, Tensor b, Tensor index) {
  const char* op = "conv_gather_sum";
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
  a = torch::stable::contiguous(a);
  b = torch::stable::contiguous(b);
  index = torch::stable::contiguous(index);
  const int64_t na = a.size(0), nb = b.size(0), C = a.size(1), R = index.size(0);
  const int M = static_cast<int>(index.size(1));
  if (a.is_cpu()) check_index_range(op, "index", index, -1, na + nb, false);
  Tensor out = torch::stable::new_empty(a, {R, C});
  if (R == 0 || C == 0) return out;
  const DType dt = conv_dtype(a.scalar_type());
  if (a.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(a);
      conv::gather_sum_cuda(out.mutable_data_ptr(), R, a.const_data_ptr(), na, b.const_data_ptr(),
                            index.const_data_ptr<int64_t>(), M, C, dt, cs.stream);
    });
  } else {
    conv::gather_sum_cpu(out.mutable_data_ptr(), R, a.const_data_ptr(), na, b.const_data_ptr(),
                         index.const_data_ptr<int64_t>(), M, C, dt);
  }
  return out;
}

}  // namespace
}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def("causal_conv1d_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? cu_seqlens, Tensor? prefix, "
        "int activation) -> Tensor");
  m.def("causal_conv1d_bwd(Tensor grad_y, Tensor x, Tensor weight, Tensor? bias, Tensor? cu_seqlens, "
        "Tensor? prefix, int activation) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("conv_gather_sum(Tensor a, Tensor b, Tensor index) -> Tensor");
}

#define PC_CONV_IMPLS(m)                                                    \
  m.impl("causal_conv1d_fwd", TORCH_BOX(&packcuda::th::causal_conv1d_fwd)); \
  m.impl("causal_conv1d_bwd", TORCH_BOX(&packcuda::th::causal_conv1d_bwd)); \
  m.impl("conv_gather_sum", TORCH_BOX(&packcuda::th::conv_gather_sum));

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) { PC_CONV_IMPLS(m) }
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) { PC_CONV_IMPLS(m) }
#endif
