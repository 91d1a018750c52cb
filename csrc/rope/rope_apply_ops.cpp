// Torch layer of the rotary application: schemas, argument checks, dispatch to the core kernels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checked.h"
#include "common/torch/checks.h"
#include "rope/rope_apply.h"
#include "rope/rope_math.h"

namespace packcuda::th {
namespace {

using torch::stable::Device;

// Metadata tensor on the data's device: device tensors are used as they are (no copy); CPU tensors for a
// CUDA op are uploaded with a non-blocking copy (no sync).
Tensor on_device(const Tensor& meta, const Tensor& data) {
  if (data.is_cpu() || !meta.is_cpu()) return meta;
  return torch::stable::to(dense(meta), data.device(), /*non_blocking=*/true);
}

// An uninitialized output shaped like t: t's layout when t is dense in another order or a view (empty_like), else a
// plain contiguous allocation (the same layout, without a dispatcher round trip).
Tensor output_like(const Tensor& t) {
  return t.is_contiguous() ? new_like(t, shape_of(t)) : torch::stable::empty_like(t);
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
                 int64_t rotary_dim, const std::vector<int64_t>& mrope_section, bool mrope_interleaved, bool gptj,
                 double attention_scaling) {
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
  PC_ARG(
      inv_freq.is_cpu() || (q.is_cuda() && inv_freq.is_cuda() && inv_freq.get_device_index() == q.get_device_index()),
      op, "inv_freq is on ", device_str(inv_freq), " but q is on ", device_str(q));

  // positions: plain [T] / [B*S], or [B, S] ([1, T] for q [T, H, D]); mRoPE the same behind a dim of 3 rows (t, h,
  // w) or of 4 rows whose first holds the text positions (transformers' and Megatron's [4, B, S]; not read here)
  const bool mrope = !mrope_section.empty();
  check_dtype(op, "positions", positions, {ST::Int, ST::Long});
  const int64_t rows_dims = mrope ? 1 : 0;
  const bool flat = positions.dim() == rows_dims + 1;
  const bool batched = positions.dim() == rows_dims + 2;
  const char* want = mrope ? (nd == 4 ? "[3, B*S] or [3, B, S]" : "[3, T] or [3, 1, T]")
                           : (nd == 4 ? "[B*S] or [B, S]" : "[T] or [1, T]");
  PC_ARG(flat || batched, op, "positions must be ", want,
         mrope ? " (mrope_section is given; a first dim of 4 rows, text positions first, works too)" : " (plain RoPE)",
         ", got shape ", shape_str(positions));
  int64_t first_row = 0;  // the t row of mRoPE positions
  if (mrope) {
    PC_ARG(positions.size(0) == 3 || positions.size(0) == 4, op,
           "positions must have 3 rows (t, h, w) or 4 (text, t, h, w), got shape ", shape_str(positions));
    first_row = positions.size(0) - 3;
  } else {
    PC_ARG(!(batched && positions.size(0) != B && (positions.size(0) == 3 || positions.size(0) == 4)), op,
           "positions of shape ", shape_str(positions), " hold mRoPE rows (t, h, w): give mrope_section");
  }
  if (flat)
    PC_ARG(positions.size(rows_dims) == B * S, op, "positions has ", positions.size(rows_dims), " tokens but q has ",
           B * S);
  else if (nd == 4)
    PC_ARG(positions.size(rows_dims) == B && positions.size(rows_dims + 1) == S, op, "positions has shape ",
           shape_str(positions), " but q has B=", B, ", S=", S);
  else
    PC_ARG(positions.size(rows_dims) == 1 && positions.size(rows_dims + 1) == S, op, "positions has shape ",
           shape_str(positions), " but q has ", S, " tokens (", want, ")");
  PC_ARG(positions.is_cpu() ||
             (q.is_cuda() && positions.is_cuda() && positions.get_device_index() == q.get_device_index()),
         op, "positions is on ", device_str(positions), " but q is on ", device_str(q));

  int layout = rope::kPlain;
  if (mrope) {
    PC_ARG(mrope_section.size() == 3, op, "mrope_section must have 3 entries (t, h, w), got ", mrope_section.size());
    int64_t sum = 0;
    for (size_t i = 0; i < 3; ++i) {
      PC_ARG(mrope_section[i] >= 0, op, "mrope_section[", i, "] must be >= 0, got ", mrope_section[i]);
      sum = checked::add(op, "the sum of mrope_section", sum, mrope_section[i]);
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
  a.dtype = core_dtype(q.scalar_type());
  a.tokens = B * S;
  a.seq = S > 0 ? S : 1;
  a.head_dim = D;
  a.rotary_dim = rotary_dim;
  a.pos_int64 = p.positions.scalar_type() == ST::Long;
  a.pos = static_cast<const char*>(p.positions.const_data_ptr()) +
          first_row * p.positions.stride(0) * (a.pos_int64 ? 8 : 4);
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

// ---------------------------------------------------------------------------------------------------
// memory checks of the in-place op: q and k are written where they are, so neither may repeat an element
// (stride 0, self-overlapping strides), they may not share an element with each other, and the read-only
// positions / inv_freq may not lie in memory the rotation writes.
// ---------------------------------------------------------------------------------------------------
// [lo, hi) byte range; empty when lo == hi.
struct Extent {
  uintptr_t lo = 0, hi = 0;
  bool overlaps(const Extent& o) const { return lo < hi && o.lo < o.hi && lo < o.hi && o.lo < hi; }
};

// Bytes spanned by the elements of t.
Extent extent_of(const char* op, const char* name, const Tensor& t) {
  Extent e;
  if (t.numel() == 0) return e;
  int64_t span = 0;  // offset of the last element, in elements
  for (int64_t d = 0; d < t.dim(); ++d)
    span = checked::add(op, name, span, checked::mul(op, name, t.size(d) - 1, t.stride(d)));
  const int64_t es = element_size(t.scalar_type());
  e.lo = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  e.hi = e.lo + static_cast<uintptr_t>(checked::mul(op, name, checked::add(op, name, span, 1), es));
  return e;
}

// No element of an in-place output may be reached twice: no stride 0 on a dim of size > 1, and, with the dims
// ordered by stride, every stride beyond the span of the dims inside it.
void check_no_self_overlap(const char* op, const char* name, const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims of size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) <= 1) continue;
    PC_ARG(t.stride(d) != 0, op, name, " has stride 0 in dim ", d, " (size ", t.size(d),
           "): an in-place output must not repeat elements (expanded tensor?), got shape ", shape_str(t));
    dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;
  for (const auto& [stride, size] : dims) {
    PC_ARG(stride > span, op, name, " overlaps itself in memory (stride ", stride, " inside a span of ", span + 1,
           " elements): an in-place output must not repeat elements");
    span = checked::add(op, name, span, checked::mul(op, name, size - 1, stride));
  }
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

// Token dims (size > 1) of a [T, H, D] / [B, S, H, D] tensor as (size, stride), [B, S] merged when they are one
// uniform walk; outermost first.
std::vector<std::pair<int64_t, int64_t>> token_dims(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t d = 0; d < t.dim() - 2; ++d)
    if (t.size(d) > 1) out.emplace_back(t.size(d), t.stride(d));
  if (out.size() == 2 && out[0].second == out[1].first * out[1].second)
    out = {{out[0].first * out[1].first, out[1].second}};
  return out;
}

// Whether q and k (same dtype, same token shape, head_dim, extents overlapping) can share an element. Exact when q
// and k walk the tokens with the same strides (views into one fused QKV buffer); anything else is reported as
// overlapping.
bool qk_may_overlap(const Tensor& q, const Tensor& k) {
  const auto tq = token_dims(q), tk = token_dims(k);
  if (tq != tk || tq.size() > 2) return true;
  const int64_t es = element_size(q.scalar_type());
  const intptr_t diff = reinterpret_cast<intptr_t>(k.const_data_ptr()) - reinterpret_cast<intptr_t>(q.const_data_ptr());
  if (diff % es != 0) return true;
  const int64_t d0 = static_cast<int64_t>(diff / es);  // k's first element relative to q's, in elements
  const int64_t nd = q.dim();
  const int64_t D = q.size(nd - 1);  // channels of a head (contiguous)
  const int64_t hq = q.size(nd - 2), hk = k.size(nd - 2);
  const int64_t shq = q.stride(nd - 2), shk = k.stride(nd - 2);
  // outer token dim (when two remain): walked explicitly; inner one: solved in closed form
  const int64_t n_out = tq.size() == 2 ? tq[0].first : 1, s_out = tq.size() == 2 ? tq[0].second : 0;
  const int64_t n_in = tq.empty() ? 1 : tq.back().first, s_in = tq.empty() ? 0 : tq.back().second;
  constexpr int64_t kMaxWork = int64_t{1} << 24;  // beyond this many (outer offset, q head, k head) triples the
                                                  // pair is reported as overlapping rather than proven disjoint
  if (hq > kMaxWork || hk > kMaxWork || hq * hk > kMaxWork / (2 * n_out - 1)) return true;
  for (int64_t mo = -(n_out - 1); mo <= n_out - 1; ++mo)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t g = 0; g < hk; ++g) {
        // q element h*shq + c + m*s_in (+ mo*s_out) == k element d0 + g*shk + c' for channels c, c' < D
        const int64_t delta = d0 + g * shk - h * shq - mo * s_out;  // m*s_in must lie in [delta-D+1, delta+D-1]
        if (s_in == 0 || n_in == 1) {
          if (delta > -D && delta < D) return true;
          continue;
        }
        const int64_t lo = std::max(ceil_div(delta - D + 1, s_in), -(n_in - 1));
        const int64_t hi = std::min(floor_div(delta + D - 1, s_in), n_in - 1);
        if (lo <= hi) return true;
      }
  return false;
}

// Everything the in-place op needs of memory, checked after prepare (dims, dtypes, devices) and before any write.
void check_inplace_memory(const char* op, const Tensor& q, const Tensor& k, const Tensor& positions,
                          const Tensor& inv_freq, const Tensor* w_q = nullptr, const Tensor* w_k = nullptr) {
  check_no_self_overlap(op, "q", q);
  check_no_self_overlap(op, "k", k);
  const Extent eq = extent_of(op, "q", q), ek = extent_of(op, "k", k);
  const auto same_device = [](const Tensor& a, const Tensor& b) {
    return a.is_cpu() == b.is_cpu() && a.get_device_index() == b.get_device_index();
  };
  PC_ARG(!(same_device(q, k) && eq.overlaps(ek) && qk_may_overlap(q, k)), op,
         "q and k overlap in memory: the in-place rotation needs q and k to share no element");
  const std::pair<const char*, const Tensor*> reads[] = {
      {"positions", &positions}, {"inv_freq", &inv_freq}, {"q_weight", w_q}, {"k_weight", w_k}};
  for (const auto& [name, t] : reads) {
    if (t == nullptr) continue;
    const Extent e = extent_of(op, name, *t);
    PC_ARG(!(same_device(*t, q) && e.overlaps(eq)), op, name,
           " shares memory with q, which the in-place "
           "rotation writes");
    PC_ARG(!(same_device(*t, k) && e.overlaps(ek)), op, name,
           " shares memory with k, which the in-place "
           "rotation writes");
  }
}

void launch(const Tensor& q, const rope::RopeArgs& a) {
  if (a.tokens == 0 || a.q.heads + a.k.heads == 0) return;
  run_kernel(q, [&] { rope::rope_apply_cpu(a); }, [&](auto stream) { rope::rope_apply_cuda(a, stream); });
}

std::tuple<Tensor, Tensor> apply_rope(Tensor q, Tensor k, Tensor positions, Tensor inv_freq, int64_t rotary_dim,
                                      std::vector<int64_t> mrope_section, bool mrope_interleaved, bool gptj,
                                      double attention_scaling, bool inverse) {
  const char* op = "apply_rope";
  Prepared p =
      prepare(op, q, k, positions, inv_freq, rotary_dim, mrope_section, mrope_interleaved, gptj, attention_scaling);
  Tensor q_out = output_like(q);
  Tensor k_out = output_like(k);
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
  Prepared p =
      prepare(op, q, k, positions, inv_freq, rotary_dim, mrope_section, mrope_interleaved, gptj, attention_scaling);
  check_inplace_memory(op, q, k, positions, inv_freq);
  fill_view(p.args.q, q, q);
  fill_view(p.args.k, k, k);
  p.args.inverse = inverse;
  p.args.copy_passthrough = false;
  launch(q, p.args);
}

// ---------------------------------------------------------------------------------------------------
// QK norm fused with the rotation
// ---------------------------------------------------------------------------------------------------
// The norm of apply_qk_norm_rope, by name (the core's kinds, rope_math.h).
enum class Norm : int { Rms = rope::kNormRms, RmsOffset = rope::kNormRmsOffset };

Norm parse_norm(const char* op, const std::string& norm) {
  if (norm == "rms") return Norm::Rms;
  PC_ARG(norm == "rms_offset", op, "norm must be 'rms' or 'rms_offset', got '", norm, "'");
  return Norm::RmsOffset;
}

struct NormPrepared {
  Prepared p;
  rope::NormArgs n;
  Tensor w;  // the weights in the compute type when they needed a cast ([2, ld]), kept alive for the launch
};

// prepare() plus the norm's own arguments (weights, eps, norm kind).
NormPrepared prepare_norm(const char* op, const Tensor& q, const Tensor& k, const Tensor& positions,
                          const Tensor& inv_freq, const Tensor& q_weight, const Tensor& k_weight, double eps,
                          const std::string& norm, int64_t rotary_dim, const std::vector<int64_t>& mrope_section,
                          bool mrope_interleaved, bool gptj, double attention_scaling) {
  NormPrepared np{
      prepare(op, q, k, positions, inv_freq, rotary_dim, mrope_section, mrope_interleaved, gptj, attention_scaling),
      {},
      {}};
  const int64_t D = q.size(q.dim() - 1);
  PC_ARG(D <= rope::kMaxNormHeadDim, op, "head_dim must be <= ", rope::kMaxNormHeadDim, " for the fused norm, got ", D);
  PC_ARG(!gptj || D % 2 == 0, op, "head_dim must be even with gptj pairs, got ", D);
  const Norm kind = parse_norm(op, norm);
  PC_ARG(std::isfinite(eps) && eps >= 0, op, "eps must be finite and >= 0, got ", eps);
  const std::pair<const char*, const Tensor*> ws[] = {{"q_weight", &q_weight}, {"k_weight", &k_weight}};
  for (const auto& [name, w] : ws) {
    PC_ARG(w->scalar_type() == ST::Float || w->scalar_type() == q.scalar_type(), op, name,
           " must be float32 or q's dtype (", dtype_name(q.scalar_type()), "), got ", dtype_name(w->scalar_type()));
    PC_ARG(w->dim() == 1 && w->size(0) == D, op, name, " must be [head_dim] = [", D, "], got shape ", shape_str(*w));
    PC_ARG(w->is_cpu() == q.is_cpu() && w->get_device_index() == q.get_device_index(), op, name, " is on ",
           device_str(*w), " but q is on ", device_str(q));
  }
  PC_ARG(k_weight.scalar_type() == q_weight.scalar_type(), op, "k_weight has dtype ",
         dtype_name(k_weight.scalar_type()), " but q_weight has dtype ", dtype_name(q_weight.scalar_type()));
  // the kernels read the weights in the compute type (exact conversions: bf16 / fp16 / fp32 -> fp32 or fp64),
  // 16-byte aligned (the CUDA kernel reads them with vector loads): otherwise both are cast into one fresh
  // [2, ld] buffer, rows 16-byte aligned, in one pass (one launch)
  const ST acc = q.scalar_type() == ST::Double ? ST::Double : ST::Float;
  const auto usable = [&](const Tensor& w) {
    return w.scalar_type() == acc && w.is_contiguous() && reinterpret_cast<uintptr_t>(w.const_data_ptr()) % 16 == 0;
  };
  np.n.dw_dtype = core_dtype(q_weight.scalar_type());
  if (usable(q_weight) && usable(k_weight)) {
    np.n.w_q = q_weight.const_data_ptr();
    np.n.w_k = k_weight.const_data_ptr();
  } else {
    rope::WeightsCast c;
    c.D = D;
    c.ld = (D + 3) / 4 * 4;  // 16-byte rows for fp32 and fp64
    np.w = new_like(q, {2 * c.ld}, acc);
    c.w_q = q_weight.const_data_ptr();
    c.w_k = k_weight.const_data_ptr();
    c.stride_q = q_weight.stride(0);
    c.stride_k = k_weight.stride(0);
    c.w = np.n.dw_dtype;
    c.acc = core_dtype(acc);
    c.out = np.w.mutable_data_ptr();
    run_kernel(q, [&] { rope::cast_weights_cpu(c); }, [&](auto stream) { rope::cast_weights_cuda(c, stream); });
    np.n.w_q = c.out;
    np.n.w_k = static_cast<const char*>(c.out) + c.ld * dtype_size(c.acc);
  }
  np.n.eps = eps;
  np.n.norm = static_cast<int>(kind);
  return np;
}

void launch_norm(const Tensor& q, rope::NormArgs& a, bool backward) {
  if (a.r.tokens == 0 || a.r.q.heads + a.r.k.heads == 0) return;
  run_kernel(
      q,
      [&] {
        if (backward) rope::qk_norm_rope_backward_cpu(a);
        else rope::qk_norm_rope_cpu(a);
      },
      [&](auto stream) {
        if (backward) rope::qk_norm_rope_backward_cuda(a, stream);
        else rope::qk_norm_rope_cuda(a, stream);
      });
}

std::tuple<Tensor, Tensor> qk_norm_rope(Tensor q, Tensor k, Tensor positions, Tensor inv_freq, Tensor q_weight,
                                        Tensor k_weight, double eps, std::string norm, int64_t rotary_dim,
                                        std::vector<int64_t> mrope_section, bool mrope_interleaved, bool gptj,
                                        double attention_scaling) {
  const char* op = "apply_qk_norm_rope";
  NormPrepared np = prepare_norm(op, q, k, positions, inv_freq, q_weight, k_weight, eps, norm, rotary_dim,
                                 mrope_section, mrope_interleaved, gptj, attention_scaling);
  Tensor q_out = output_like(q);
  Tensor k_out = output_like(k);
  np.n.r = np.p.args;
  fill_view(np.n.r.q, q, q_out);
  fill_view(np.n.r.k, k, k_out);
  launch_norm(q, np.n, false);
  return {q_out, k_out};
}

void qk_norm_rope_(Tensor q, Tensor k, Tensor positions, Tensor inv_freq, Tensor q_weight, Tensor k_weight, double eps,
                   std::string norm, int64_t rotary_dim, std::vector<int64_t> mrope_section, bool mrope_interleaved,
                   bool gptj, double attention_scaling) {
  const char* op = "apply_qk_norm_rope_";
  NormPrepared np = prepare_norm(op, q, k, positions, inv_freq, q_weight, k_weight, eps, norm, rotary_dim,
                                 mrope_section, mrope_interleaved, gptj, attention_scaling);
  check_inplace_memory(op, q, k, positions, inv_freq, &q_weight, &k_weight);
  np.n.r = np.p.args;
  fill_view(np.n.r.q, q, q);
  fill_view(np.n.r.k, k, k);
  launch_norm(q, np.n, false);
}

// grad_q / grad_k: the gradients of the outputs (shapes of q / k, any strides, last dim contiguous); q / k: the
// forward's inputs. Returns (dq, dk, dq_weight, dk_weight), the weight gradients [D] in the weights' dtype
// (accumulated in fp32, fp64 for fp64 data, and rounded once).
std::tuple<Tensor, Tensor, Tensor, Tensor> qk_norm_rope_backward(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k,
                                                                 Tensor positions, Tensor inv_freq, Tensor q_weight,
                                                                 Tensor k_weight, double eps, std::string norm,
                                                                 int64_t rotary_dim, std::vector<int64_t> mrope_section,
                                                                 bool mrope_interleaved, bool gptj,
                                                                 double attention_scaling) {
  const char* op = "apply_qk_norm_rope_backward";
  NormPrepared np = prepare_norm(op, q, k, positions, inv_freq, q_weight, k_weight, eps, norm, rotary_dim,
                                 mrope_section, mrope_interleaved, gptj, attention_scaling);
  const std::pair<const char*, const Tensor*> grads[] = {{"grad_q", &grad_q}, {"grad_k", &grad_k}};
  for (int i = 0; i < 2; ++i) {
    const char* name = grads[i].first;
    const Tensor& g = *grads[i].second;
    const Tensor& x = i == 0 ? q : k;
    PC_ARG(shape_of(g) == shape_of(x), op, name, " must have the shape of ", i == 0 ? "q " : "k ", shape_str(x),
           ", got ", shape_str(g));
    PC_ARG(g.scalar_type() == q.scalar_type(), op, name, " has dtype ", dtype_name(g.scalar_type()),
           " but q has dtype ", dtype_name(q.scalar_type()));
    check_same_device(op, name, g, "q", q);
    PC_ARG(g.dim() == 0 || g.size(g.dim() - 1) <= 1 || g.stride(g.dim() - 1) == 1, op, name,
           " must be contiguous in its last dim (stride 1), got stride ", g.stride(g.dim() - 1));
  }
  const int64_t D = q.size(q.dim() - 1);
  const ST acc = q.scalar_type() == ST::Double ? ST::Double : ST::Float;
  Tensor dq = output_like(q);
  Tensor dk = output_like(k);
  Tensor dwq = new_like(q, {D}, q_weight.scalar_type());
  Tensor dwk = new_like(q, {D}, q_weight.scalar_type());
  np.n.r = np.p.args;
  fill_view(np.n.r.q, q, dq);
  fill_view(np.n.r.k, k, dk);
  fill_view(np.n.g_q, grad_q, grad_q);
  fill_view(np.n.g_k, grad_k, grad_k);
  np.n.dw_q = dwq.mutable_data_ptr();
  np.n.dw_k = dwk.mutable_data_ptr();
  if (np.n.r.tokens == 0 || np.n.r.q.heads + np.n.r.k.heads == 0) {
    torch::stable::zero_(dwq);
    torch::stable::zero_(dwk);
    return {dq, dk, dwq, dwk};
  }
  Tensor ws;
  if (q.is_cuda()) {
    ws = new_like(q, {rope::qk_norm_workspace_floats(D)}, acc);
    np.n.workspace = ws.mutable_data_ptr();
  }
  launch_norm(q, np.n, true);
  return {dq, dk, dwq, dwk};
}

// Largest rotary_dim the kernels take (the facade's default_inv_freq refuses larger ones by this bound).
int64_t rope_max_rotary_dim() { return rope::kMaxRotaryDim; }
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
  m.def(
      "apply_qk_norm_rope(Tensor q, Tensor k, Tensor positions, Tensor inv_freq, Tensor q_weight, Tensor k_weight, "
      "float eps, str norm, int rotary_dim, int[] mrope_section, bool mrope_interleaved=False, bool gptj=False, "
      "float attention_scaling=1.) -> (Tensor, Tensor)");
  m.def(
      "apply_qk_norm_rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor inv_freq, Tensor q_weight, "
      "Tensor k_weight, float eps, str norm, int rotary_dim, int[] mrope_section, bool mrope_interleaved=False, "
      "bool gptj=False, float attention_scaling=1.) -> ()");
  m.def(
      "apply_qk_norm_rope_backward(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, Tensor positions, Tensor "
      "inv_freq, "
      "Tensor q_weight, Tensor k_weight, float eps, str norm, int rotary_dim, int[] mrope_section, "
      "bool mrope_interleaved=False, bool gptj=False, float attention_scaling=1.) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("rope_max_rotary_dim() -> int");
}

STABLE_TORCH_LIBRARY_IMPL(packcuda, CompositeExplicitAutograd, m) { PC_IMPL(m, "rope_max_rotary_dim", &packcuda::th::rope_max_rotary_dim); }

#define PC_ROPE_APPLY_IMPLS(m)                                     \
  PC_IMPL(m, "apply_rope", &packcuda::th::apply_rope);             \
  PC_IMPL(m, "apply_rope_", &packcuda::th::apply_rope_);           \
  PC_IMPL(m, "apply_qk_norm_rope", &packcuda::th::qk_norm_rope);   \
  PC_IMPL(m, "apply_qk_norm_rope_", &packcuda::th::qk_norm_rope_); \
  PC_IMPL(m, "apply_qk_norm_rope_backward", &packcuda::th::qk_norm_rope_backward);

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) { PC_ROPE_APPLY_IMPLS(m) }
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) { PC_ROPE_APPLY_IMPLS(m) }
#endif
