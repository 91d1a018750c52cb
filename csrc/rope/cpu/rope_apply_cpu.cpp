#include <cstring>
#include <type_traits>
#include <vector>

#include "common/dispatch.h"
#include "rope/rope_apply.h"
#include "rope/rope_math.h"

namespace packcuda::rope {
namespace {

template <typename T>
void rotate_heads(const RopeArgs& a, const HeadsView& v, int64_t t, const typename Acc<T>::type* cs) {
  using F = typename Acc<T>::type;
  const int64_t n = a.rotary_dim / 2;
  const T* in = static_cast<const T*>(v.in) + token_offset(t, a.seq, v.in_sb, v.in_ss);
  T* out = static_cast<T*>(v.out) + token_offset(t, a.seq, v.out_sb, v.out_ss);
  for (int64_t h = 0; h < v.heads; ++h) {
    const T* x = in + h * v.in_sh;
    T* y = out + h * v.out_sh;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t lo = pair_lo(j, a.gptj), hi = pair_hi(j, n, a.gptj);
      F ylo, yhi;
      rotate_pair(Elem<T>::load(x[lo]), Elem<T>::load(x[hi]), cs[2 * j], cs[2 * j + 1], &ylo, &yhi);
      y[lo] = Elem<T>::store(ylo);
      y[hi] = Elem<T>::store(yhi);
    }
    if (a.copy_passthrough && a.rotary_dim < a.head_dim && y != x)
      std::memmove(y + a.rotary_dim, x + a.rotary_dim, (a.head_dim - a.rotary_dim) * sizeof(T));
  }
}

template <typename T>
void run(const RopeArgs& a) {
  const int64_t n = a.rotary_dim / 2;
  using F = typename Acc<T>::type;
  std::vector<F> cs(2 * n);
  for (int64_t t = 0; t < a.tokens; ++t) {
    const int64_t pos_t = token_offset(t, a.seq, a.pos_sb, a.pos_ss);
    for (int64_t j = 0; j < n; ++j) {
      const int r = slot_axis(j, a.layout, a.section[0], a.section[1], a.section[2]);
      const int64_t off = r * a.pos_row_stride + pos_t;
      const int64_t pos =
          a.pos_int64 ? static_cast<const int64_t*>(a.pos)[off] : static_cast<const int32_t*>(a.pos)[off];
      rope_cos_sin(rope_angle(pos, a.inv_freq[j]), static_cast<F>(a.scaling), a.inverse, &cs[2 * j], &cs[2 * j + 1]);
    }
    rotate_heads<T>(a, a.q, t, cs.data());
    rotate_heads<T>(a, a.k, t, cs.data());
  }
}

}  // namespace

void rope_apply_cpu(const RopeArgs& a) {
  if (a.tokens == 0) return;
  dispatch_dtype(a.dtype, [&](auto tag) { run<decltype(tag)>(a); });
}

namespace {

// ---------------------------------------------------------------------------------------------------
// QK norm + rotation
// ---------------------------------------------------------------------------------------------------
template <typename T>
struct NormRow {
  using F = typename Acc<T>::type;
  static F round(F v) { return Elem<T>::load(Elem<T>::store(v)); }
  // weight channel c (the weights are in the compute type)
  static F weight(const NormArgs&, const void* w, int64_t c) { return static_cast<const F*>(w)[c]; }
};

// cos/sin of every slot of token t (inverse: the rotation by the negated angle).
template <typename F>
void token_cos_sin(const RopeArgs& a, int64_t t, bool inverse, F* cs) {
  const int64_t n = a.rotary_dim / 2;
  const int64_t pos_t = token_offset(t, a.seq, a.pos_sb, a.pos_ss);
  for (int64_t j = 0; j < n; ++j) {
    const int r = slot_axis(j, a.layout, a.section[0], a.section[1], a.section[2]);
    const int64_t off = r * a.pos_row_stride + pos_t;
    const int64_t pos = a.pos_int64 ? static_cast<const int64_t*>(a.pos)[off] : static_cast<const int32_t*>(a.pos)[off];
    rope_cos_sin(rope_angle(pos, a.inv_freq[j]), static_cast<F>(a.scaling), inverse, &cs[2 * j], &cs[2 * j + 1]);
  }
}

// Forward of the heads of one view at token t: x -> y = rotate(gain * xhat).
template <typename T>
void norm_rotate_heads(const NormArgs& na, const HeadsView& v, const void* w, int64_t t,
                       const typename Acc<T>::type* cs, typename Acc<T>::type* buf) {
  using F = typename Acc<T>::type;
  using R = NormRow<T>;
  const RopeArgs& a = na.r;
  const int64_t D = a.head_dim, n = a.rotary_dim / 2;
  const T* in = static_cast<const T*>(v.in) + token_offset(t, a.seq, v.in_sb, v.in_ss);
  T* out = static_cast<T*>(v.out) + token_offset(t, a.seq, v.out_sb, v.out_ss);
  const F eps = static_cast<F>(na.eps);
  for (int64_t h = 0; h < v.heads; ++h) {
    const T* x = in + h * v.in_sh;
    T* y = out + h * v.out_sh;
    F ss = 0;
    for (int64_t c = 0; c < D; ++c) {
      buf[c] = Elem<T>::load(x[c]);
      ss += buf[c] * buf[c];
    }
    const F rstd = norm_rstd(ss, D, eps);
    for (int64_t c = 0; c < D; ++c)
      buf[c] = norm_gain(R::weight(na, w, c), na.norm) * norm_xhat(buf[c], rstd, na.norm, R::round);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t lo = pair_lo(j, a.gptj), hi = pair_hi(j, n, a.gptj);
      F ylo, yhi;
      rotate_pair(buf[lo], buf[hi], cs[2 * j], cs[2 * j + 1], &ylo, &yhi);
      y[lo] = Elem<T>::store(ylo);
      y[hi] = Elem<T>::store(yhi);
    }
    for (int64_t c = a.rotary_dim; c < D; ++c) y[c] = Elem<T>::store(buf[c]);
  }
}

// Backward of the heads of one view at token t; dw accumulates (in double) over the rows in token order.
template <typename T>
void norm_rotate_heads_backward(const NormArgs& na, const HeadsView& v, const HeadsView& g, const void* w, int64_t t,
                                const typename Acc<T>::type* cs, typename Acc<T>::type* buf, double* dw) {
  using F = typename Acc<T>::type;
  using R = NormRow<T>;
  const RopeArgs& a = na.r;
  const int64_t D = a.head_dim, n = a.rotary_dim / 2;
  const T* xin = static_cast<const T*>(v.in) + token_offset(t, a.seq, v.in_sb, v.in_ss);
  const T* gin = static_cast<const T*>(g.in) + token_offset(t, a.seq, g.in_sb, g.in_ss);
  T* out = static_cast<T*>(v.out) + token_offset(t, a.seq, v.out_sb, v.out_ss);
  const F eps = static_cast<F>(na.eps);
  F* gn = buf;       // gradient w.r.t. the normalized row
  F* xs = buf + D;   // the input row
  for (int64_t h = 0; h < v.heads; ++h) {
    const T* x = xin + h * v.in_sh;
    const T* gr = gin + h * g.in_sh;
    T* dx = out + h * v.out_sh;
    F ss = 0;
    for (int64_t c = 0; c < D; ++c) {
      xs[c] = Elem<T>::load(x[c]);
      ss += xs[c] * xs[c];
      gn[c] = Elem<T>::load(gr[c]);
    }
    const F rstd = norm_rstd(ss, D, eps);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t lo = pair_lo(j, a.gptj), hi = pair_hi(j, n, a.gptj);
      F glo, ghi;
      rotate_pair(gn[lo], gn[hi], cs[2 * j], cs[2 * j + 1], &glo, &ghi);
      gn[lo] = glo;
      gn[hi] = ghi;
    }
    F dot = 0;
    for (int64_t c = 0; c < D; ++c) {
      dw[c] += static_cast<double>(gn[c] * norm_xhat(xs[c], rstd, na.norm, R::round));
      gn[c] *= norm_gain(R::weight(na, w, c), na.norm);  // dxh
      dot += gn[c] * xs[c] * rstd;
    }
    for (int64_t c = 0; c < D; ++c) dx[c] = Elem<T>::store(norm_dx(gn[c], xs[c], rstd, dot, D));
  }
}

template <typename T>
void run_norm(const NormArgs& na) {
  using F = typename Acc<T>::type;
  const RopeArgs& a = na.r;
  std::vector<F> cs(a.rotary_dim), buf(a.head_dim);
  for (int64_t t = 0; t < a.tokens; ++t) {
    token_cos_sin(a, t, false, cs.data());
    norm_rotate_heads<T>(na, a.q, na.w_q, t, cs.data(), buf.data());
    norm_rotate_heads<T>(na, a.k, na.w_k, t, cs.data(), buf.data());
  }
}

template <typename T>
void run_norm_backward(const NormArgs& na) {
  using F = typename Acc<T>::type;
  const RopeArgs& a = na.r;
  const int64_t D = a.head_dim;
  std::vector<F> cs(a.rotary_dim), buf(2 * D);
  std::vector<double> dwq(D, 0.0), dwk(D, 0.0);
  for (int64_t t = 0; t < a.tokens; ++t) {
    token_cos_sin(a, t, true, cs.data());
    norm_rotate_heads_backward<T>(na, a.q, na.g_q, na.w_q, t, cs.data(), buf.data(), dwq.data());
    norm_rotate_heads_backward<T>(na, a.k, na.g_k, na.w_k, t, cs.data(), buf.data(), dwk.data());
  }
  dispatch_dtype(na.dw_dtype, [&](auto wt) {
    using W = decltype(wt);
    for (int64_t c = 0; c < D; ++c) {
      weight_grad_out<W, F>(na.dw_q, c, static_cast<F>(dwq[c]));
      weight_grad_out<W, F>(na.dw_k, c, static_cast<F>(dwk[c]));
    }
  });
}

template <template <typename> class Run, typename A>
void by_dtype(DType d, const A& a) {
  dispatch_dtype(d, [&](auto tag) { Run<decltype(tag)>::go(a); });
}
template <typename T> struct NormFwd {
  static void go(const NormArgs& a) { run_norm<T>(a); }
};
template <typename T> struct NormBwd {
  static void go(const NormArgs& a) { run_norm_backward<T>(a); }
};

}  // namespace

void cast_weights_cpu(const WeightsCast& a) {
  dispatch_bool(a.acc == DType::F64, [&](auto f64) {
    using F = std::conditional_t<decltype(f64)::value, double, float>;
    dispatch_dtype(a.w, [&](auto wt) {
      using W = decltype(wt);
      for (int64_t c = 0; c < a.D; ++c) {
        static_cast<F*>(a.out)[c] = weight_in<W, F>(a.w_q, c, a.stride_q);
        static_cast<F*>(a.out)[a.ld + c] = weight_in<W, F>(a.w_k, c, a.stride_k);
      }
    });
  });
}

void qk_norm_rope_cpu(const NormArgs& a) { by_dtype<NormFwd>(a.r.dtype, a); }

void qk_norm_rope_backward_cpu(const NormArgs& a) { by_dtype<NormBwd>(a.r.dtype, a); }

}  // namespace packcuda::rope
