// Torch layer of the rotary application: schemas, argument checks, dispatch to the core kernels.
#include <cmath>
#include <tuple>
#include <vector>

#include "common/torch/checks.h"
#include "rope/rope_apply.h"
#include "rope/rope_math.h"

namespace packcuda::th {
namespace {

using torch::stable::Device;

// The one element type the kernels rotate.
rope::Dtype rope_dtype(ST t) {
  switch (t) {
    case ST::BFloat16: return rope::Dtype::kBFloat16;
    case ST::Half: return rope::Dtype::kFloat16;
    case ST::Double: return rope::Dtype::kFloat64;
    default: return rope::Dtype::kFloat32;
  }
}

// Metadata tensor on the data's device: device tensors are used as they are (no copy); CPU tensors for a
// CUDA op are uploaded with a non-blocking copy (no sync).
Tensor on_device(const Tensor& meta, const Tensor& data) {
  if (data.is_cpu() || !meta.is_cpu()) return meta;
  return torch::stable::to(dense(meta), data.device(), /*non_blocking=*/true);
}

struct Prepared {
  rope::RopeArgs args;
  Tensor positions, inv_freq;  // kept alive for the launch
};

void fill_view(rope::HeadsView& v, const Tensor& in, const Tensor& out) {
  const bool four = in.dim() == 4;
  v.in = in.const_data_ptr();
  v.out = out.mutable_data_ptr();
  v.heads = in.size(four ? 2 : 1);
  v.in_sb = four ? in.stride(0) : 0;
  v.in_ss = in.stride(four ? 1 : 0);
  v.in_sh = in.stride(four ? 2 : 1);
  v.out_sb = four ? out.stride(0) : 0;
  v.out_ss = out.stride(four ? 1 : 0);
  v.out_sh = out.stride(four ? 2 : 1);
}

// Validates everything before any kernel writes; shared by the out-of-place and in-place ops.
Prepared prepare(const char* op, const Tensor& q, const Tensor& k, const Tensor& positions, const Tensor& inv_freq,
                 int64_t rotary_dim, const std::vector<int64_t>& mrope_section, bool mrope_interleaved,
                 bool gptj, double attention_scaling) {
  PC_ARG(q.dim() == 3 || q.dim() == 4, op, "q must be [T, Hq, D] or [B, S, Hq, D], got shape ", shape_str(q));
  PC_ARG(k.dim() == q.dim(), op, "k must have as many dims as q (", q.dim(), "), got shape ", shape_str(k));
  check_dtype(op, "q", q, {ST::BFloat16, ST::Half, ST::Float, ST::Double});
  PC_ARG(k.scalar_type() == q.scalar_type(), op, "k has dtype ", dtype_name(k.scalar_type()), " but q has dtype ",
         dtype_name(q.scalar_type()));
  check_same_device(op, "k", k, "q", q);
  const int64_t nd = q.dim();
  const int64_t B = nd == 4 ? q.size(0) : 1;
  const int64_t S = q.size(nd - 3);
  for (int64_t d = 0; d < nd - 2; ++d)
    PC_ARG(k.size(d) == q.size(d), op, "q and k must have the same tokens, got q ", shape_str(q), " and k ",
           shape_str(k));
  const int64_t D = q.size(nd - 1);
  PC_ARG(k.size(nd - 1) == D, op, "q and k must have the same head_dim, got ", D, " and ", k.size(nd - 1));
  PC_ARG(D <= 1 || q.stride(nd - 1) == 1, op, "q must be contiguous in its last dim (stride 1), got stride ",
         q.stride(nd - 1));
  PC_ARG(D <= 1 || k.stride(nd - 1) == 1, op, "k must be contiguous in its last dim (stride 1), got stride ",
         k.stride(nd - 1));
  PC_ARG(rotary_dim > 0 && rotary_dim % 2 == 0, op, "rotary_dim must be a positive even number, got ", rotary_dim);
  PC_ARG(rotary_dim <= D, op, "rotary_dim (", rotary_dim, ") must be <= head_dim (", D, ")");
  PC_ARG(rotary_dim <= rope::kMaxRotaryDim, op, "rotary_dim must be <= ", rope::kMaxRotaryDim, ", got ", rotary_dim);
  const int64_t n = rotary_dim / 2;
  PC_ARG(std::isfinite(attention_scaling), op, "attention_scaling must be finite, got ", attention_scaling);

  check_dtype(op, "inv_freq", inv_freq, {ST::Float});
  check_dim(op, "inv_freq", inv_freq, 1);
  PC_ARG(inv_freq.numel() == n, op, "inv_freq must have rotary_dim / 2 = ", n, " entries, got ", inv_freq.numel());
  PC_ARG(inv_freq.is_cpu() || (q.is_cuda() && inv_freq.is_cuda() &&
                               inv_freq.get_device_index() == q.get_device_index()),
         op, "inv_freq is on ", device_str(inv_freq), " but q is on ", device_str(q));

  // positions: plain [T] / [B, S]; mRoPE [3, T] / [3, B, S]
  const bool mrope = !mrope_section.empty();
  check_dtype(op, "positions", positions, {ST::Int, ST::Long});
  const int64_t rows_dims = mrope ? 1 : 0;
  const bool flat = positions.dim() == rows_dims + 1;
  const bool batched = nd == 4 && positions.dim() == rows_dims + 2;
  const char* want = mrope ? (nd == 4 ? "[3, B*S] or [3, B, S]" : "[3, T]") : (nd == 4 ? "[B*S] or [B, S]" : "[T]");
  PC_ARG(flat || batched, op, "positions must be ", want, mrope ? " (mrope_section is given)" : " (plain RoPE)",
         ", got shape ", shape_str(positions));
  if (mrope) PC_ARG(positions.size(0) == 3, op, "positions must have 3 rows (t, h, w), got shape ", shape_str(positions));
  if (flat)
    PC_ARG(positions.size(rows_dims) == B * S, op, "positions has ", positions.size(rows_dims),
           " tokens but q has ", B * S);
  else
    PC_ARG(positions.size(rows_dims) == B && positions.size(rows_dims + 1) == S, op, "positions has shape ",
           shape_str(positions), " but q has B=", B, ", S=", S);
  PC_ARG(positions.is_cpu() || (q.is_cuda() && positions.is_cuda() &&
                                positions.get_device_index() == q.get_device_index()),
         op, "positions is on ", device_str(positions), " but q is on ", device_str(q));

  int layout = rope::kPlain;
  if (mrope) {
    PC_ARG(mrope_section.size() == 3, op, "mrope_section must have 3 entries (t, h, w), got ",
           mrope_section.size());
    int64_t sum = 0;
    for (size_t i = 0; i < 3; ++i) {
      PC_ARG(mrope_section[i] >= 0, op, "mrope_section[", i, "] must be >= 0, got ", mrope_section[i]);
      sum += mrope_section[i];
    }
    PC_ARG(sum == n, op, "mrope_section [", mrope_section[0], ", ", mrope_section[1], ", ", mrope_section[2],
           "] sums to ", sum, " but rotary_dim / 2 = ", n);
    layout = mrope_interleaved ? rope::kInterleaved : rope::kSectioned;
  } else {
    PC_ARG(!mrope_interleaved, op, "mrope_interleaved needs an mrope_section");
  }

  Prepared p;
  p.positions = on_device(positions, q);
  p.inv_freq = on_device(dense(inv_freq), q);
  rope::RopeArgs& a = p.args;
  a.dtype = rope_dtype(q.scalar_type());
  a.tokens = B * S;
  a.seq = S > 0 ? S : 1;
  a.head_dim = D;
  a.rotary_dim = rotary_dim;
  a.pos = p.positions.const_data_ptr();
  a.pos_int64 = p.positions.scalar_type() == ST::Long;
  a.pos_row_stride = mrope ? p.positions.stride(0) : 0;
  if (flat) {
    const int64_t st = p.positions.stride(rows_dims);
    a.pos_ss = st;
    a.pos_sb = st * S;
  } else {
    a.pos_sb = p.positions.stride(rows_dims);
    a.pos_ss = p.positions.stride(rows_dims + 1);
  }
  a.inv_freq = p.inv_freq.const_data_ptr<float>();
  a.layout = layout;
  for (int i = 0; i < 3; ++i) a.section[i] = mrope ? mrope_section[i] : 0;
  a.gptj = gptj;
  a.scaling = attention_scaling;
  return p;
}

void launch(const Tensor& q, const rope::RopeArgs& a) {
  if (a.tokens == 0 || a.q.heads + a.k.heads == 0) return;
  if (q.is_cuda()) {
    PC_CUDA_ONLY({
      CudaScope cs(q);
      rope::rope_apply_cuda(a, cs.stream);
    });
  } else {
    rope::rope_apply_cpu(a);
  }
}

std::tuple<Tensor, Tensor> apply_rope(Tensor q, Tensor k, Tensor positions, Tensor inv_freq, int64_t rotary_dim,
                                      std::vector<int64_t> mrope_section, bool mrope_interleaved, bool gptj,
                                      double attention_scaling, bool inverse) {
  const char* op = "apply_rope";
  Prepared p = prepare(op, q, k, positions, inv_freq, rotary_dim, mrope_section, mrope_interleaved, gptj,
                       attention_scaling);
  Tensor q_out = torch::stable::empty_like(q);
  Tensor k_out = torch::stable::empty_like(k);
  fill_view(p.args.q, q, q_out);
  fill_view(p.args.k, k, k_out);
  p.args.inverse = inverse;
  p.args.copy_passthrough = true;
  launch(q, p.args);
  return {q_out, k_out};
}

void apply_rope_(Tensor q, Tensor k, Tensor positions, Tensor inv_freq, int64_t rotary_dim,
                 std::vector<int64_t> mrope_section, bool mrope_interleaved, bool gptj, double attention_scaling,
                 bool inverse) {
  const char* op = "apply_rope_";
  Prepared p = prepare(op, q, k, positions, inv_freq, rotary_dim, mrope_section, mrope_interleaved, gptj,
                       attention_scaling);
  PC_ARG(q.numel() == 0 || k.numel() == 0 || q.const_data_ptr() != k.const_data_ptr(), op,
         "q and k must be different tensors for the in-place version");
  fill_view(p.args.q, q, q);
  fill_view(p.args.k, k, k);
  p.args.inverse = inverse;
  p.args.copy_passthrough = false;
  launch(q, p.args);
}

}  // namespace
}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def(
      "apply_rope(Tensor q, Tensor k, Tensor positions, Tensor inv_freq, int rotary_dim, int[] mrope_section, "
      "bool mrope_interleaved=False, bool gptj=False, float attention_scaling=1., bool inverse=False) "
      "-> (Tensor, Tensor)");
  m.def(
      "apply_rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor inv_freq, int rotary_dim, "
      "int[] mrope_section, bool mrope_interleaved=False, bool gptj=False, float attention_scaling=1., "
      "bool inverse=False) -> ()");
}

#define PC_ROPE_APPLY_IMPLS(m)                                  \
  m.impl("apply_rope", TORCH_BOX(&packcuda::th::apply_rope));   \
  m.impl("apply_rope_", TORCH_BOX(&packcuda::th::apply_rope_));

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) { PC_ROPE_APPLY_IMPLS(m) }
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) { PC_ROPE_APPLY_IMPLS(m) }
#endif
