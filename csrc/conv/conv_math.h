// Math of the varlen causal depthwise conv1d, shared by the CPU and CUDA
// kernels. Every function here is written once and called per (channel, token tile) by both backends.
//
// Convention (x, y: [T, C] row-major; weight [C, K]; prefix [S, K-1, C]):
//   z[t, c] = bias[c] + sum_k weight[c, k] * xin(t - (K-1) + k, c),   y = act(z)
//   xin(u, c) = x[u, c] if u >= start of t's segment s, else prefix[s, K-1 + (u - start), c] (0 without prefix).
// Windows are kept right-aligned in arrays of a compile-time size KM >= K: slot m holds tap k = m - (KM - K);
// slots below KM - K carry no tap and are masked out (never multiplied, so inf/NaN cannot leak in).
#pragma once
#include <cmath>
#include <cstdint>

#include "../common/dtype.h"
#include "../common/hd.h"
#include "../common/vec.h"
#include "conv.h"

namespace packcuda::conv {

PC_HD float sigmoid(float z) {
#if defined(__CUDA_ARCH__)
  // exp(-z) = 2^(-z log2 e); a flushed subnormal changes nothing (1 + it rounds to 1); 1 / inf = 0
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -1.4426950408889634f));
  return __fdividef(1.f, 1.f + e);
#else
  return 1.f / (1.f + std::exp(-z));
#endif
}
PC_HD double sigmoid(double z) {
#if defined(__CUDA_ARCH__)
  return 1.0 / (1.0 + ::exp(-z));
#else
  return 1.0 / (1.0 + std::exp(-z));
#endif
}
// Activation codes: 0 = identity, 1 = silu.
template <typename A> PC_HD A activate(A z, int act) { return act == 1 ? z * sigmoid(z) : z; }
template <typename A> PC_HD A activate_grad(A z, int act) {
  if (act != 1) return A(1);
  const A s = sigmoid(z);
  return s * (A(1) + z * (A(1) - s));
}

// ---------------------------------------------------------------------------------------- conv shapes
struct ConvShape {
  int64_t T;     // tokens
  int64_t C;     // channels
  int K;         // kernel size, 1 <= K <= kMaxK
  int64_t nseg;  // segments in cu (cu has nseg + 1 entries)
  int act;       // 0 identity, 1 silu
};

// Where the tile functions read rows of x and dy: at(u, c) is the address of element (u, c). Dense rows are
// the tensor itself (row stride ld); the CUDA kernels pass a shared-memory copy of the rows a tile needs (the
// same math then reads the staged copy).
template <typename S> struct DenseRows {
  const S* p;
  int64_t ld;
  PC_HD const S* at(int64_t u, int64_t c) const { return p + u * ld + c; }
};

// Where the tile functions read prefix rows: at(s, j, c) is the address of prefix[s, j, c] (0 <= j < K-1), and
// none() says there are none (every entry before a segment's start is then zero). DensePrefix is the tensor
// itself (none when p is null); NoPrefix is none at compile time, so a kernel built for it carries no prefix
// code (the CUDA backward without a prefix).
template <typename S> struct DensePrefix {
  const S* p;
  int64_t C;
  int km1;  // K - 1
  PC_HD bool none() const { return p == nullptr; }
  PC_HD const S* at(int64_t s, int64_t j, int64_t c) const { return p + (s * km1 + j) * C + c; }
};
template <typename S> struct NoPrefix {
  static constexpr bool none() { return true; }
  PC_HD const S* at(int64_t, int64_t, int64_t) const { return nullptr; }
};

// Input value seen by a token of segment s (starting at `start`) at stream position u (u may be < start).
template <typename S, typename A, typename Rows, typename Pre>
PC_HD A conv_input(const Rows& x, const Pre& pf, const ConvShape& sh, int64_t s, int64_t start, int64_t u, int64_t c) {
  if (u >= start) return val(*x.at(u, c));
  if (pf.none()) return A(0);
  return val(*pf.at(s, (sh.K - 1) + (u - start), c));  // row 0 <= j < K-1
}

// The K-1 prefix rows of one segment for channels c .. c+V-1 in the compute type (row j in slot j; zeros
// without a prefix). The backward's tile walk loads them together as it enters a segment, instead of one
// dependent load per step over the segment's first K-1 tokens.
template <typename S, int KM, int V> struct PrefixRows {
  using A = typename Acc<S>::type;
  A r[V][KM - 1];
  template <typename Pre> PC_HD void load(const Pre& pf, const ConvShape& sh, int64_t s, int64_t c) {
    PC_UNROLL
    for (int v = 0; v < V; ++v) PC_UNROLL
    for (int j = 0; j < KM - 1; ++j) r[v][j] = !pf.none() && j < sh.K - 1 ? val(*pf.at(s, j, c + v)) : A(0);
  }
  // Row j (0 <= j < K-1) of channel c + v: a select over static slots (keeps r in registers).
  PC_HD A at(int v, int64_t j) const {
    A out = A(0);
    PC_UNROLL
    for (int m = 0; m < KM - 1; ++m)
      if (m == j) out = r[v][m];
    return out;
  }
};

// Token tiles: tile i covers [i * len, min(T, (i + 1) * len)).
struct Tiles {
  int64_t count;
  int64_t len;
};
PC_HD Tiles make_tiles(int64_t T, int64_t want_count) {
  if (T <= 0) return Tiles{0, 1};
  if (want_count < 1) want_count = 1;
  if (want_count > T) want_count = T;
  const int64_t len = ceil_div(T, want_count);
  return Tiles{ceil_div(T, len), len};
}

// Tokens per batch of independent loads issued before the dependent arithmetic (memory-level parallelism).
constexpr int kBatch = 8;

// Taps and bias of channels c .. c+V-1 in the compute type: w[v][m] is tap m - off (off = KM - K); slots below
// off are zero and never multiplied.
template <typename S, int KM, int V> struct ConvTaps {
  using A = typename Acc<S>::type;
  A w[V][KM];
  A b[V];
  PC_HD ConvTaps(const S* wt, const S* bias, int K, int off, int64_t c) {
    PC_UNROLL
    for (int v = 0; v < V; ++v) {
      PC_UNROLL
      for (int m = 0; m < KM; ++m) w[v][m] = m >= off ? val(wt[(c + v) * K + (m - off)]) : A(0);
      b[v] = bias ? val(bias[c + v]) : A(0);
    }
  }
};

// One forward output: z = bias + sum_m w[m] * win[m] (the K-1 inputs before the token) + w[KM-1] * xt, then the
// window moves on by one token (xt enters it).
template <typename A, int KM> PC_HD A conv_fwd_z(const A (&w)[KM], A bias, A (&win)[KM - 1], A xt, int off) {
  A z = bias;
  PC_UNROLL
  for (int m = 0; m < KM - 1; ++m)
    if (m >= off) z += w[m] * win[m];
  z += w[KM - 1] * xt;
  PC_UNROLL
  for (int m = 0; m < KM - 2; ++m) win[m] = win[m + 1];
  win[KM - 2] = xt;
  return z;
}

// Forward over tokens [t0, t1) of channels c .. c+V-1 (each channel gets exactly the scalar math; the V
// channels only share the loads/stores of a row and the segment walk).
// tp: the taps of those channels (ConvTaps); s0: the segment holding t0 (find_segment(cu, nseg, t0); a caller
// that walks its tokens in order already knows it).
template <typename S, int KM, int V = 1, int NB = kBatch, int ACT = -1, bool kExact = false, typename Rows,
          typename Pre>
PC_HD void conv_fwd_tile(const Rows& x, const ConvTaps<S, KM, V>& tp, const Pre& pf, const int64_t* cu,
                         const ConvShape& sh, S* y, int64_t c, int64_t t0, int64_t t1, int64_t s0) {
  static_assert(KM >= 2 && KM <= kMaxK, "window size");
  using A = typename Acc<S>::type;
  const int off = KM - (kExact ? KM : sh.K);
  const int act = ACT >= 0 ? ACT : sh.act;
  if (t1 <= t0) return;
  int64_t s = s0;
  int64_t start = cu[s], end = cu[s + 1];
  A win[V][KM - 1];  // win[v][m] = xin(t - (KM-1) + m, c + v) for m < KM-1
  PC_UNROLL
  for (int v = 0; v < V; ++v) PC_UNROLL
  for (int m = 0; m < KM - 1; ++m)
    win[v][m] = m >= off ? conv_input<S, A>(x, pf, sh, s, start, t0 - (KM - 1) + m, c + v) : A(0);
  for (int64_t tb = t0; tb < t1; tb += NB) {
    Vec<S, V> xs[NB];
    PC_UNROLL
    for (int i = 0; i < NB; ++i) xs[i] = tb + i < t1 ? load_vec<V>(x.at(tb + i, c)) : zero_vec<V, S>();
    PC_UNROLL
    for (int i = 0; i < NB; ++i) {
      const int64_t t = tb + i;
      if (t >= t1) break;
      if (t >= end) {  // entering the next non-empty segment, which starts at t
        do ++s;
        while (cu[s + 1] <= t);
        start = cu[s];
        end = cu[s + 1];
        PC_UNROLL
        for (int v = 0; v < V; ++v) PC_UNROLL
        for (int m = 0; m < KM - 1; ++m)
          win[v][m] = m >= off ? conv_input<S, A>(x, pf, sh, s, start, t - (KM - 1) + m, c + v) : A(0);
      }
      Vec<S, V> out;
      PC_UNROLL
      for (int v = 0; v < V; ++v)
        out.v[v] = from_acc<S>(activate(conv_fwd_z<A, KM>(tp.w[v], tp.b[v], win[v], val(xs[i].v[v]), off), act));
      store_vec<V>(y + t * sh.C + c, out);
    }
  }
}

// Forward over the R tokens [t0, t0 + R) of channels c .. c+V-1 when they and the K-1 rows before t0 all lie in
// one segment (the window is read from the rows: no prefix, no boundary; the caller checks). y_row points at
// y[t0, c]; rows are ldy elements apart; R is a multiple of NB. The same per-token math as conv_fwd_tile.
template <typename S, int KM, int V, int R, int NB, int ACT, bool kExact, typename Rows>
PC_HD void conv_fwd_interior(const Rows& x, const ConvTaps<S, KM, V>& tp, const ConvShape& sh, S* y_row, int64_t ldy,
                             int64_t t0, int64_t c) {
  using A = typename Acc<S>::type;
  const int off = KM - (kExact ? KM : sh.K);
  const int act = ACT >= 0 ? ACT : sh.act;
  A win[V][KM - 1];
  PC_UNROLL
  for (int m = 0; m < KM - 1; ++m) {
    const Vec<S, V> r = load_vec<V>(x.at(t0 - (KM - 1) + m, c));
    PC_UNROLL
    for (int v = 0; v < V; ++v) win[v][m] = m >= off ? val(r.v[v]) : A(0);
  }
  for (int i0 = 0; i0 < R; i0 += NB) {  // NB tokens at a time: their loads are issued together
    PC_UNROLL
    for (int i = i0; i < i0 + NB; ++i) {
      const Vec<S, V> xs = load_vec<V>(x.at(t0 + i, c));
      Vec<S, V> out;
      PC_UNROLL
      for (int v = 0; v < V; ++v)
        out.v[v] = from_acc<S>(activate(conv_fwd_z<A, KM>(tp.w[v], tp.b[v], win[v], val(xs.v[v]), off), act));
      store_vec<V>(y_row + i * ldy, out);
    }
  }
}

// Pre-activation z at token t of segment s, computed from scratch (tile edges of the backward).
template <typename S, int KM, typename A, bool kExact = false, typename Rows, typename Pre>
PC_HD A conv_z_at(const Rows& x, const Pre& pf, const A* wk, A bias, const ConvShape& sh, int64_t s, int64_t start,
                  int64_t t, int64_t c) {
  const int off = KM - (kExact ? KM : sh.K);
  A z = bias;
  PC_UNROLL
  for (int m = 0; m < KM; ++m)
    if (m >= off) z += wk[m] * conv_input<S, A>(x, pf, sh, s, start, t - (KM - 1) + m, c);
  return z;
}

// One backward step at token t of one channel (the walk goes downwards): with xw[m] = xin(t - (KM-1) + m) and
// g[d] = gz(t + d) for d >= 1 (zero outside t's segment), computes gz(t) = dy(t) * act'(z(t)) into g[0], returns
// dx(t) = sum_m w[m] * g[KM-1-m], and adds gz(t) * xw[m] to dw[m] and gz(t) to db.
template <typename A, int KM>
PC_HD A conv_bwd_step(const A (&w)[KM], A bias, const A (&xw)[KM], A (&g)[KM], A dyt, A (&dw)[KM], A& db, int off,
                      int act) {
  A z = bias;
  PC_UNROLL
  for (int m = 0; m < KM; ++m)
    if (m >= off) z += w[m] * xw[m];
  const A gz = dyt * activate_grad(z, act);
  g[0] = gz;
  A gx = A(0);
  PC_UNROLL
  for (int m = 0; m < KM; ++m)
    if (m >= off) gx += w[m] * g[KM - 1 - m];
  PC_UNROLL
  for (int m = 0; m < KM; ++m)
    if (m >= off) dw[m] += gz * xw[m];
  db += gz;
  return gx;
}

// The step from t to t - 1 inside one segment: g moves up by one, and x(t - K) enters the window at slot off.
template <typename A, int KM> PC_HD void conv_bwd_shift(A (&xw)[KM], A (&g)[KM], A in, int off) {
  PC_UNROLL
  for (int d = KM - 1; d > 0; --d) g[d] = g[d - 1];
  PC_UNROLL
  for (int m = KM - 1; m > 0; --m) xw[m] = m == off ? in : xw[m - 1];
  xw[0] = off == 0 ? in : A(0);
}

// Backward over tokens [t0, t1) of channels c .. c+V-1 (taps tp), walking t downwards. Writes dx[t, c+v] for t
// in the tile, dprefix[s, :, c+v] for every non-empty segment that starts in the tile (when dprefix is given),
// and adds this tile's sums of dweight[c+v, :] and dbias[c+v] to dw[v][m] (slot m = tap m - (KM - K)) and db[v].
// s1: the segment holding t1 - 1 (find_segment(cu, nseg, t1 - 1), or known to the caller).
//   dx[u]         = sum_k w[k] * gz[u + K-1-k]      over taps inside u's segment
//   dprefix[s, j] = sum_k w[k] * gz[start + j - k]  (prefix row j sits at u = start - (K-1) + j)
//   dw[k]         = sum_t gz[t] * xin(t - (K-1) + k),  db = sum_t gz[t],  gz = dy * act'(z)
template <typename S, int KM, int V = 1, int NB = kBatch, int ACT = -1, bool kExact = false, typename DyRows,
          typename XRows, typename Pre>
PC_HD void conv_bwd_tile(const DyRows& dy, const XRows& x, const ConvTaps<S, KM, V>& tp, const Pre& pf,
                         const int64_t* cu, const ConvShape& sh, S* dx, S* dprefix, int64_t c, int64_t t0, int64_t t1,
                         int64_t s1, typename Acc<S>::type (&dw)[V][KM], typename Acc<S>::type (&db)[V]) {
  static_assert(KM >= 2 && KM <= kMaxK, "window size");
  using A = typename Acc<S>::type;
  const int K = kExact ? KM : sh.K;
  const int off = KM - K;
  const int act = ACT >= 0 ? ACT : sh.act;
  if (t1 > t0) {
    int64_t t = t1 - 1;
    int64_t s = s1;
    int64_t start = cu[s], end = cu[s + 1];
    PrefixRows<S, KM, V> pre;  // segment s's prefix rows (the window's entries before its start)
    pre.load(pf, sh, s, c);
    A g[V][KM];   // g[v][d] = gz(t + d) if t + d is in t's segment, else 0 (only d < K carry weight)
    A xw[V][KM];  // xw[v][m] = xin(t - (KM-1) + m)
    PC_UNROLL
    for (int v = 0; v < V; ++v) {
      g[v][0] = A(0);
      PC_UNROLL
      for (int d = 1; d < KM; ++d) {
        g[v][d] = A(0);
        if (d < K && t + d < end) {
          const A z = conv_z_at<S, KM, A, kExact>(x, pf, tp.w[v], tp.b[v], sh, s, start, t + d, c + v);
          g[v][d] = val(*dy.at(t + d, c + v)) * activate_grad(z, act);
        }
      }
      PC_UNROLL
      for (int m = 0; m < KM; ++m)
        xw[v][m] = m >= off ? conv_input<S, A>(x, pf, sh, s, start, t - (KM - 1) + m, c + v) : A(0);
    }
    for (int64_t tb = t1 - 1; tb >= t0; tb -= NB) {
      Vec<S, V> dys[NB], xr[NB];  // dy[t], and raw x[t - K] (enters the window at the step to t - 1)
      PC_UNROLL
      for (int i = 0; i < NB; ++i) {
        const int64_t tt = tb - i;
        dys[i] = tt >= t0 ? load_vec<V>(dy.at(tt, c)) : zero_vec<V, S>();
        xr[i] = (tt >= t0 && tt - K >= 0) ? load_vec<V>(x.at(tt - K, c)) : zero_vec<V, S>();
      }
      PC_UNROLL
      for (int i = 0; i < NB; ++i) {
        if (t < t0) break;
        Vec<S, V> dxo;
        PC_UNROLL
        for (int v = 0; v < V; ++v)
          dxo.v[v] = from_acc<S>(
              conv_bwd_step<A, KM>(tp.w[v], tp.b[v], xw[v], g[v], val(dys[i].v[v]), dw[v], db[v], off, act));
        store_vec<V>(dx + t * sh.C + c, dxo);
        if (t == start && dprefix != nullptr) {
          PC_UNROLL
          for (int j = 0; j < KM - 1; ++j) {  // j < K - 1; unrolled so g stays in registers
            if (j >= K - 1) break;
            PC_UNROLL
            for (int v = 0; v < V; ++v) {
              A acc = A(0);
              PC_UNROLL
              for (int m = 0; m < KM; ++m) {
                const int d = j + off - m;  // tap t' = start + d
                if (m >= off && d >= 0) acc += tp.w[v][m] * g[v][d];
              }
              dprefix[(s * (K - 1) + j) * sh.C + c + v] = from_acc<S>(acc);
            }
          }
        }
        --t;
        if (t < t0) break;
        if (t < start) {  // into the previous non-empty segment, which ends at t + 1
          do --s;
          while (cu[s] > t);
          start = cu[s];
          end = cu[s + 1];
          pre.load(pf, sh, s, c);
          PC_UNROLL
          for (int v = 0; v < V; ++v) {
            PC_UNROLL
            for (int d = 0; d < KM; ++d) g[v][d] = A(0);
            PC_UNROLL
            for (int m = 0; m < KM; ++m)
              xw[v][m] = m >= off ? conv_input<S, A>(x, pf, sh, s, start, t - (KM - 1) + m, c + v) : A(0);
          }
        } else {
          // the row entering the window is u = t - (K-1), at slot off (the first slot carrying a tap)
          const int64_t u = t - (K - 1);
          PC_UNROLL
          for (int v = 0; v < V; ++v)
            conv_bwd_shift<A, KM>(xw[v], g[v], u >= start ? val(xr[i].v[v]) : pre.at(v, (K - 1) + (u - start)), off);
        }
      }
    }
  }
}

// Backward over the R tokens [t0, t0 + R) of channels c .. c+V-1 when the rows they read - x over
// [t0 - (K-1), t0 + R + K-1), dy over [t0, t0 + R + K-1) - all lie in the segment of t0, which starts before
// t0 - (K-1) (no prefix, no boundary, no segment start; the caller checks). dx_row points at dx[t0, c]; rows are
// ldx elements apart; R is a multiple of NB. The same per-token math as conv_bwd_tile, in the same order.
template <typename S, int KM, int V, int R, int NB, int ACT, bool kExact, typename DyRows, typename XRows>
PC_HD void conv_bwd_interior(const DyRows& dy, const XRows& x, const ConvTaps<S, KM, V>& tp, const ConvShape& sh,
                             S* dx_row, int64_t ldx, int64_t t0, int64_t c, typename Acc<S>::type (&dw)[V][KM],
                             typename Acc<S>::type (&db)[V]) {
  using A = typename Acc<S>::type;
  const int K = kExact ? KM : sh.K;
  const int off = KM - K;
  const int act = ACT >= 0 ? ACT : sh.act;
  const int64_t tl = t0 + R - 1;  // the first token of the walk
  A g[V][KM], xw[V][KM];
  PC_UNROLL
  for (int v = 0; v < V; ++v) g[v][0] = A(0);
  PC_UNROLL
  for (int d = 1; d < KM; ++d) {  // gz of the K-1 tokens after the run (the next run's; recomputed)
    Vec<S, V> dv = zero_vec<V, S>();
    if (d < K) dv = load_vec<V>(dy.at(tl + d, c));
    A z[V];
    PC_UNROLL
    for (int v = 0; v < V; ++v) z[v] = tp.b[v];
    PC_UNROLL
    for (int m = 0; m < KM; ++m) {
      if (d >= K || m < off) continue;
      const Vec<S, V> r = load_vec<V>(x.at(tl + d - (KM - 1) + m, c));
      PC_UNROLL
      for (int v = 0; v < V; ++v) z[v] += tp.w[v][m] * val(r.v[v]);
    }
    PC_UNROLL
    for (int v = 0; v < V; ++v) g[v][d] = d < K ? val(dv.v[v]) * activate_grad(z[v], act) : A(0);
  }
  PC_UNROLL
  for (int m = 0; m < KM; ++m) {
    const Vec<S, V> r = m >= off ? load_vec<V>(x.at(tl - (KM - 1) + m, c)) : zero_vec<V, S>();
    PC_UNROLL
    for (int v = 0; v < V; ++v) xw[v][m] = m >= off ? val(r.v[v]) : A(0);
  }
  for (int i0 = 0; i0 < R; i0 += NB) {
    Vec<S, V> dys[NB], xr[NB];
    PC_UNROLL
    for (int i = 0; i < NB; ++i) {
      dys[i] = load_vec<V>(dy.at(tl - (i0 + i), c));
      xr[i] = load_vec<V>(x.at(tl - (i0 + i) - K, c));
    }
    PC_UNROLL
    for (int i = 0; i < NB; ++i) {
      Vec<S, V> dxo;
      PC_UNROLL
      for (int v = 0; v < V; ++v)
        dxo.v[v] =
            from_acc<S>(conv_bwd_step<A, KM>(tp.w[v], tp.b[v], xw[v], g[v], val(dys[i].v[v]), dw[v], db[v], off, act));
      store_vec<V>(dx_row + (R - 1 - (i0 + i)) * ldx, dxo);
      PC_UNROLL
      for (int v = 0; v < V; ++v) conv_bwd_shift<A, KM>(xw[v], g[v], val(xr[i].v[v]), off);
    }
  }
}

// Zeroed accumulators for conv_bwd_tile, and their store as one tile's partials part[v*(K+1) .. v*(K+1)+K]
// (dweight taps 0..K-1, then dbias) of channels c .. c+V-1.
template <typename A, int V, int KM> PC_HD void conv_zero_partials(A (&dw)[V][KM], A (&db)[V]) {
  PC_UNROLL
  for (int v = 0; v < V; ++v) {
    PC_UNROLL
    for (int m = 0; m < KM; ++m) dw[v][m] = A(0);
    db[v] = A(0);
  }
}
template <typename A, int V, int KM>
PC_HD void conv_store_partials(const A (&dw)[V][KM], const A (&db)[V], int K, A* part) {
  const int off = KM - K;
  PC_UNROLL
  for (int v = 0; v < V; ++v) {
    PC_UNROLL
    for (int m = 0; m < KM; ++m)  // static indices into dw (keeps it in registers)
      if (m >= off) part[v * (K + 1) + (m - off)] = dw[v][m];
    part[v * (K + 1) + K] = db[v];
  }
}

// Fixed-order reduction of the per-tile partials part[tile][c][K+1] (tile-major, so element e = c*(K+1) + k
// of every tile sits at part[tile * C*(K+1) + e]): dweight[c, k] for k < K, dbias[c] for k = K. The sum runs
// over tiles in increasing order whatever the batching (deterministic).
template <typename S>
PC_HD void conv_reduce_elem(const typename Acc<S>::type* part, int64_t ntiles, const ConvShape& sh, S* dweight,
                            S* dbias, int64_t e) {
  using A = typename Acc<S>::type;
  const int K = sh.K;
  const int64_t stride = sh.C * (K + 1);
  const int64_t c = e / (K + 1);
  const int k = static_cast<int>(e - c * (K + 1));
  A acc = A(0);
  int64_t i = 0;
  for (; i + kBatch <= ntiles; i += kBatch) {
    A p[kBatch];
    PC_UNROLL
    for (int j = 0; j < kBatch; ++j) p[j] = part[(i + j) * stride + e];
    PC_UNROLL
    for (int j = 0; j < kBatch; ++j) acc += p[j];
  }
  for (; i < ntiles; ++i) acc += part[i * stride + e];
  if (k < K) dweight[c * K + k] = from_acc<S>(acc);
  else if (dbias) dbias[c] = from_acc<S>(acc);
}

// All K + 1 reductions of channel c.
template <typename S>
PC_HD void conv_reduce_channel(const typename Acc<S>::type* part, int64_t ntiles, const ConvShape& sh, S* dweight,
                               S* dbias, int64_t c) {
  for (int k = 0; k <= sh.K; ++k) conv_reduce_elem<S>(part, ntiles, sh, dweight, dbias, c * (sh.K + 1) + k);
}

}  // namespace packcuda::conv
