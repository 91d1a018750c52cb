// Fused QK norm + rotation on the GPU, the tile kernel (every shape); the warp-per-token kernels of the common
// shapes are in qk_norm_wtok_cuda.cu.
#include <algorithm>
#include <type_traits>

#include "rope/cuda/rope_cuda_common.cuh"

namespace packcuda::rope {
namespace {
using namespace detail;

// ===================================================================================================
// QK norm fused with the rotation. One pass: every (token, head) row is read once, normalized, rotated and
// written once. A group of G lanes (a power of two <= 32) owns one row at a time; each lane holds up to UPL
// units of the row in registers, a unit being one rotary vector pair (neox: the chunk of the first half and
// its partner n channels later), one rotary vector (gptj: pairs inside the vector) or one pass-through vector,
// of VE elements each. The row's sum of squares is a butterfly over the group's lanes (every lane ends with
// the same bits). Blocks take tiles of tokens; cos/sin of every (token, slot) of the tile are computed once
// into shared memory; a tile's q rows are done first, then its k rows (the weight is uniform over the block).
// The backward reads x and the gradient once, writes dx once and keeps each lane's weight gradients of the
// current phase in registers, then adds them into its group's own slot in shared memory; the block sums the
// groups' slots in group order into one [2, D] partial, and a second kernel sums the partials in block order.
// Fixed orders throughout: no atomics; no allocation, no sync. The forward and the backward of 2-byte types on
// the 16-byte path with neox pairs, head_dim 64, 128 or 256 and rotary_dim a multiple of 16 run another
// structure instead, one warp per token (qk_norm_fwd_wtok_kernel, qk_norm_bwd_wtok_kernel in qk_norm_wtok_cuda.cu):
// a warp walks all q then k heads of each of its tokens, a fixed number of rows per step, with its loads issued
// steps ahead into registers and the token's cos/sin in a per-warp table; the two kernels share the lane layout,
// the walk, the table, the gains and the row addressing. The tile kernel runs everything else.
// ===================================================================================================
constexpr int kNThreads = 256;
constexpr int kNWarps = kNThreads / 32;
constexpr int kNMaxTok = 32;
constexpr int kNSmemBudget = 16 * 1024;  // cos/sin table of a tile
// Rows per group per tile the tile size aims at: the per-tile prologue (token offsets, barriers, cos/sin) is
// shared by this many rows of every group.
constexpr int kNRowsFwd = 8;
constexpr int kNRowsBwd = 4;

struct NParams {
  NormArgs a;
  int n;      // rotary_dim / 2
  int P;      // rotary units per row
  int U;      // units per row (rotary + pass-through)
  int G;      // lanes per row
  int hq, H;  // q heads, q + k heads
  int tok;    // tokens per tile
  int cs_bytes;  // shared memory of the cos/sin table (16-byte multiple); the backward's wacc follows
  int dq[2], dr[2];  // a step of one block's worth of rows (kNThreads / G) in phase q / k: dq tokens, dr heads
  bool d_pow2;       // head_dim is a power of two: v / D == v * (1 / D) exactly
  int64_t tiles;
};

struct NBase {
  int64_t x[2], y[2], g[2], pos;  // token offsets: inputs, outputs, gradients of q / k; positions
};

template <typename F>
__device__ __forceinline__ F group_sum(F v, int G) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    if (off < G) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <typename T, int VE, int ALIGN, int UPL, bool GPTJ, bool BWD, int NK>
__global__ void __launch_bounds__(kNThreads, BWD ? (UPL == 1 ? 2 : 1) : (UPL == 1 ? 3 : 2))
    qk_norm_kernel(const NParams p) {
  using V = Vec<T, VE, ALIGN>;
  using F = typename Elem<T>::compute;
  // frequency slots per rotary unit: neox VE (the unit's first-half chunk), gptj VE / 2 (pairs in the vector)
  constexpr int NS = GPTJ ? VE / 2 : VE;
  // the weights' vector of a unit: 16-byte loads on the vector path (the weights are 16-byte aligned, see the
  // ops layer, and a unit's first channel is a multiple of VE), element loads otherwise
  using WV = Vec<F, VE, (ALIGN == 16 ? 16 : alignof(F))>;
  const NormArgs& a = p.a;
  const RopeArgs& r = a.r;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // cos/sin of a tile, [tok][n]: slot j = u * NS + m (unit u, m < NS) of a token at cs_entry(u, m), so that the
  // G lanes of a group (consecutive units) read consecutive entries: with NS even the pairs (m, m + 1) of a unit
  // are adjacent, one 16-byte read, and the units' pairs (u, mp) at mp * P + u.
  CosSin<F>* cs = reinterpret_cast<CosSin<F>*>(smem_raw);
  __shared__ NBase base[kNMaxTok];

  const int G = p.G, n = p.n, P = p.P, U = p.U, hq = p.hq, H = p.H;
  const int D = static_cast<int>(r.head_dim), rd = static_cast<int>(r.rotary_dim);
  const int lane = threadIdx.x % G, grp = threadIdx.x / G, gpb = kNThreads / G;
  const F eps = static_cast<F>(a.eps);
  const int kind = NK >= 0 ? NK : a.norm;
  const bool d_pow2 = p.d_pow2;
  const F d_inv = F(1) / static_cast<F>(D);
  auto div_d = [&](F v) { return d_pow2 ? v * d_inv : v / static_cast<F>(D); };
  auto round = [](F v) { return Elem<T>::load(Elem<T>::store(v)); };
  // first channel of unit u, and whether it has a partner vector (neox rotary units)
  auto unit_lo = [&](int u) { return u < P ? u * VE : rd + (u - P) * VE; };
  // rotates the NS pairs of rotary unit u in place: (a[m], b[m]) for neox, (a[2m], a[2m + 1]) for gptj
  auto rotate_unit = [&](const CosSin<F>* cst, int u, F* va, F* vb) {
    auto one = [&](int m, const CosSin<F>& cw) {
      F& lo = GPTJ ? va[2 * m] : va[m];
      F& hi = GPTJ ? va[2 * m + 1] : vb[m];
      F o0, o1;
      rotate_pair<F>(lo, hi, cw.c, cw.s, &o0, &o1);
      lo = o0;
      hi = o1;
    };
    if constexpr (NS % 2 == 0) {
      const CosSin2<F>* c2 = reinterpret_cast<const CosSin2<F>*>(cst);
#pragma unroll
      for (int mp = 0; mp < NS / 2; ++mp) {
        const CosSin2<F> cw = c2[mp * P + u];
        one(2 * mp, cw.a);
        one(2 * mp + 1, cw.b);
      }
    } else {
      static_assert(NS == 1, "odd slot counts per unit are single slots");
      one(0, cst[u]);
    }
  };

  // backward: this lane's weight gradients of the current phase (registers), flushed at the end of each phase
  // into its group's slot of wacc [groups][q, k][D] (shared memory, after the cos/sin table)
  F acc[UPL][2][VE];
  F* wacc = reinterpret_cast<F*>(smem_raw + p.cs_bytes);
  if constexpr (BWD) {
#pragma unroll
    for (int i = 0; i < UPL; ++i)
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int m = 0; m < VE; ++m) acc[i][s][m] = F(0);
    for (int c = threadIdx.x; c < gpb * 2 * D; c += kNThreads) wacc[c] = F(0);
  }

  for (int64_t tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const int64_t t0 = tile * p.tok;
    const int ntok = static_cast<int>(min(static_cast<int64_t>(p.tok), r.tokens - t0));
    __syncthreads();  // the previous tile's rows are done with base / cs
    for (int tl = threadIdx.x; tl < ntok; tl += kNThreads) {
      const TokenIndex ti(t0 + tl, r.seq);
      NBase b;
      b.x[0] = ti.offset(r.q.in_sb, r.q.in_ss);
      b.x[1] = ti.offset(r.k.in_sb, r.k.in_ss);
      b.y[0] = ti.offset(r.q.out_sb, r.q.out_ss);
      b.y[1] = ti.offset(r.k.out_sb, r.k.out_ss);
      b.g[0] = BWD ? ti.offset(a.g_q.in_sb, a.g_q.in_ss) : 0;
      b.g[1] = BWD ? ti.offset(a.g_k.in_sb, a.g_k.in_ss) : 0;
      b.pos = ti.offset(r.pos_sb, r.pos_ss);
      base[tl] = b;
    }
    __syncthreads();
    // table entry e of a token -> slot j (the inverse of the layout above): consecutive threads store
    // consecutive entries
    fill_cos_sin<F>(
        cs, r, ntok, n, BWD, [&](int tl) { return base[tl].pos; },
        [&](int e) {
          if constexpr (NS % 2 == 0) {
            const int q2 = e >> 1, mp = q2 / P, u = q2 - mp * P;
            return u * NS + 2 * mp + (e & 1);
          } else {
            return e;
          }
        });
    __syncthreads();

    // q rows first, then k rows: the phase (and so the weight) is uniform over the block
#pragma unroll 1
    for (int ph = 0; ph < 2; ++ph) {
      const bool is_q = ph == 0;
      const int Hp = is_q ? hq : H - hq;
      const int rows = ntok * Hp;
      const F* w = static_cast<const F*>(is_q ? a.w_q : a.w_k);
      const int dq = is_q ? p.dq[0] : p.dq[1], dr = is_q ? p.dr[0] : p.dr[1];
      // this group's row (tl, hh) = (row / Hp, row % Hp), advanced by gpb rows per step
      int ctl = Hp > 0 ? grp / Hp : 0;
      int chh = grp - ctl * Hp;
      for (int rb = 0; rb < rows; rb += gpb) {  // uniform trip count: every lane reaches the shuffles
        const bool active = ctl < ntok;
        const int tl = active ? ctl : 0;
        const int hh = active ? chh : 0;
        chh += dr;
        ctl += dq;
        if (chh >= Hp) {
          chh -= Hp;
          ++ctl;
        }
        // (fields picked one by one: no dynamic reference into the kernel parameters)
        const T* xin = is_q ? static_cast<const T*>(r.q.in) + base[tl].x[0] + hh * r.q.in_sh
                            : static_cast<const T*>(r.k.in) + base[tl].x[1] + hh * r.k.in_sh;
        T* yout = is_q ? static_cast<T*>(r.q.out) + base[tl].y[0] + hh * r.q.out_sh
                       : static_cast<T*>(r.k.out) + base[tl].y[1] + hh * r.k.out_sh;
        const T* gin = nullptr;
        if constexpr (BWD)
          gin = is_q ? static_cast<const T*>(a.g_q.in) + base[tl].g[0] + hh * a.g_q.in_sh
                     : static_cast<const T*>(a.g_k.in) + base[tl].g[1] + hh * a.g_k.in_sh;
        const CosSin<F>* cst = cs + tl * n;

        F x[UPL][2][VE], g[UPL][2][VE];
        F ss = F(0);
#pragma unroll
        for (int i = 0; i < UPL; ++i) {
          const int u = lane + i * G;
          const bool ok = active && u < U;
          const bool pair = !GPTJ && u < P;
          const int lo = unit_lo(u);
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            V xv, gv;
            const bool load = ok && (s == 0 || pair);
            if (load) {
              const int c = s == 0 ? lo : lo + n;
              xv = *reinterpret_cast<const V*>(xin + c);
              if constexpr (BWD) gv = *reinterpret_cast<const V*>(gin + c);
            }
#pragma unroll
            for (int m = 0; m < VE; ++m) {
              x[i][s][m] = load ? Elem<T>::load(xv.v[m]) : F(0);
              if constexpr (BWD) g[i][s][m] = load ? Elem<T>::load(gv.v[m]) : F(0);
              ss += x[i][s][m] * x[i][s][m];
            }
          }
        }
        ss = group_sum(ss, G);
        const F rstd = norm_rstd_of_var(div_d(ss), eps);

        if constexpr (!BWD) {
#pragma unroll
          for (int i = 0; i < UPL; ++i) {
            const int u = lane + i * G;
            if (!(active && u < U)) continue;
            const bool rot = u < P;
            const int lo = unit_lo(u);
            // the unit's weights (cached reads of the [D] weights), after the reduction: fewer live registers
            const WV w0 = *reinterpret_cast<const WV*>(w + lo);
            WV w1;
            if constexpr (!GPTJ) {
              if (rot) {
                w1 = *reinterpret_cast<const WV*>(w + lo + n);
              } else {
#pragma unroll
                for (int m = 0; m < VE; ++m) w1.v[m] = F(0);
              }
            }
            // the normalized values of the unit; the rotary units rotate them in place (the branch holds only the
            // rotation, so a row group with rotary and pass-through lanes runs the normalization once)
            F nv[2][VE];
#pragma unroll
            for (int s = 0; s < (GPTJ ? 1 : 2); ++s)
#pragma unroll
              for (int m = 0; m < VE; ++m)
                nv[s][m] = norm_gain(s == 0 ? w0.v[m] : w1.v[m], kind) * norm_xhat(x[i][s][m], rstd, kind, round);
            if (rot) rotate_unit(cst, u, nv[0], nv[1]);
            V y0, y1;
#pragma unroll
            for (int m = 0; m < VE; ++m) {
              y0.v[m] = Elem<T>::store(nv[0][m]);
              if (!GPTJ) y1.v[m] = Elem<T>::store(nv[1][m]);
            }
            *reinterpret_cast<V*>(yout + lo) = y0;
            if (!GPTJ && rot) *reinterpret_cast<V*>(yout + lo + n) = y1;
          }
        } else {
          // gn = R(-a) g on the rotary pairs; then dxh = gn * gain, dot = sum(dxh * xhat), weight gradients
          F dot = F(0);
#pragma unroll
          for (int i = 0; i < UPL; ++i) {
            const int u = lane + i * G;
            const bool ok = active && u < U;
            const bool rot = u < P;
            const int lo = unit_lo(u);
            WV w0, w1;
            if (ok) w0 = *reinterpret_cast<const WV*>(w + lo);
            if (ok && !GPTJ && rot) w1 = *reinterpret_cast<const WV*>(w + lo + n);
            if (ok && rot) rotate_unit(cst, u, g[i][0], g[i][1]);
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
              for (int m = 0; m < VE; ++m) {
                const bool live = ok && (s == 0 || (!GPTJ && rot));
                const F xh = norm_xhat(x[i][s][m], rstd, kind, round);
                acc[i][s][m] += live ? g[i][s][m] * xh : F(0);
                g[i][s][m] = live ? g[i][s][m] * norm_gain(s == 0 ? w0.v[m] : w1.v[m], kind) : F(0);  // dxh
                dot += g[i][s][m] * (x[i][s][m] * rstd);
              }
          }
          dot = group_sum(dot, G);
          const F dot_d = div_d(dot);
#pragma unroll
          for (int i = 0; i < UPL; ++i) {
            const int u = lane + i * G;
            if (!(active && u < U)) continue;
            const bool pair = !GPTJ && u < P;
            const int lo = unit_lo(u);
#pragma unroll
            for (int s = 0; s < 2; ++s) {
              if (s == 1 && !pair) continue;
              V y;
#pragma unroll
              for (int m = 0; m < VE; ++m) y.v[m] = Elem<T>::store(norm_dx_of(g[i][s][m], x[i][s][m], rstd, dot_d));
              *reinterpret_cast<V*>(yout + (s == 0 ? lo : lo + n)) = y;
            }
          }
        }
      }
      if constexpr (BWD) {
        // this phase's weight gradients of the tile into the group's own slot (lanes own disjoint channels), one
        // vector of VE channels at a time
#pragma unroll
        for (int i = 0; i < UPL; ++i) {
          const int u = lane + i * G;
          const bool pair = !GPTJ && u < P;
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            if (u < U && (s == 0 || pair)) {
              WV* slot = reinterpret_cast<WV*>(wacc + (grp * 2 + ph) * D + (s == 0 ? unit_lo(u) : unit_lo(u) + n));
              WV v = *slot;
#pragma unroll
              for (int m = 0; m < VE; ++m) v.v[m] += acc[i][s][m];
              *slot = v;
            }
#pragma unroll
            for (int m = 0; m < VE; ++m) acc[i][s][m] = F(0);
          }
        }
      }
    }  // phases
  }

  if constexpr (BWD) {
    // this block's weight-gradient partial: the groups' slots summed in group order
    __syncthreads();
    F* part = static_cast<F*>(a.workspace) + static_cast<int64_t>(blockIdx.x) * 2 * D;
    for (int c = threadIdx.x; c < 2 * D; c += kNThreads) {
      F sum = F(0);
      for (int gi = 0; gi < gpb; ++gi) sum += wacc[gi * 2 * D + c];
      part[c] = sum;
    }
  }
}
// dw[c] = sum over blocks b (in order) of part[b][c], c over the 2 * D channels of q and k, written as W.
template <typename F, typename W>
__global__ void __launch_bounds__(kNThreads)
    reduce_partials(const F* part, int nblocks, int D, void* dw_q, void* dw_k) {
  __shared__ F red[kNWarps][32];
  const int warp = threadIdx.x / 32, wl = threadIdx.x % 32;
  const int c = blockIdx.x * 32 + wl;
  const int C = 2 * D;
  F s = F(0);
  if (c < C)
    for (int b = warp; b < nblocks; b += kNWarps) s += part[static_cast<int64_t>(b) * C + c];
  red[warp][wl] = s;
  __syncthreads();
  if (warp == 0 && c < C) {
    F t = F(0);
    for (int wi = 0; wi < kNWarps; ++wi) t += red[wi][wl];
    if (c < D) weight_grad_out<W, F>(dw_q, c, t);
    else weight_grad_out<W, F>(dw_k, c - D, t);
  }
}

// The weights in the compute type, both in one launch (rope_apply.h: WeightsCast).
template <typename W, typename F>
__global__ void cast_weights_kernel(const WeightsCast a) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= 2 * a.D) return;
  const bool k = i >= a.D;
  const int64_t c = k ? i - a.D : i;
  static_cast<F*>(a.out)[(k ? a.ld : 0) + c] = weight_in<W, F>(k ? a.w_k : a.w_q, c, k ? a.stride_k : a.stride_q);
}

template <typename T, int VE, int ALIGN, int UPL, bool GPTJ, int NK>
void launch(const NormArgs& a, int U, int P, int G, bool bwd, cudaStream_t stream) {
  using F = typename Elem<T>::compute;
  NParams p;
  p.a = a;
  p.n = static_cast<int>(a.r.rotary_dim / 2);
  p.P = P;
  p.U = U;
  p.G = G;
  p.hq = static_cast<int>(a.r.q.heads);
  p.H = static_cast<int>(a.r.q.heads + a.r.k.heads);
  const int gpb = kNThreads / G;
  // forward: a power of two of tokens with about kNRowsFwd rows per group. backward: kNRowsBwd rows per group,
  // not rounded: the tiles fix how the weight gradients are grouped (the sum of a phase's rows of a tile is
  // added into wacc once), so they are kept as they were and dw keeps its bits.
  int64_t tok = (kNRowsBwd * gpb + p.H - 1) / p.H;
  if (!bwd) {
    const int64_t want = (kNRowsFwd * gpb + p.H - 1) / p.H;
    for (tok = 1; tok < want; tok <<= 1) {
    }
  }
  const int64_t smem_tok = kNSmemBudget / (p.n * static_cast<int64_t>(sizeof(CosSin<F>)));
  tok = std::max<int64_t>(1, std::min<int64_t>({tok, smem_tok, kNMaxTok}));
  const int hk = p.H - p.hq;
  p.dq[0] = p.hq > 0 ? gpb / p.hq : 0;
  p.dr[0] = p.hq > 0 ? gpb % p.hq : 0;
  p.dq[1] = hk > 0 ? gpb / hk : 0;
  p.dr[1] = hk > 0 ? gpb % hk : 0;
  p.d_pow2 = (a.r.head_dim & (a.r.head_dim - 1)) == 0;
  p.tok = static_cast<int>(tok);
  p.tiles = (a.r.tokens + tok - 1) / tok;
  const size_t cs_bytes = (static_cast<size_t>(tok) * p.n * sizeof(CosSin<F>) + 15) / 16 * 16;
  p.cs_bytes = static_cast<int>(cs_bytes);
  const int D = static_cast<int>(a.r.head_dim);
  if (!bwd) {
    auto kern = qk_norm_kernel<T, VE, ALIGN, UPL, GPTJ, false, NK>;
    if (cs_bytes + sizeof(NBase) * kNMaxTok > 48 * 1024)
      PC_CUDA_CHECK(
          cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(cs_bytes)));
    kern<<<static_cast<unsigned>(p.tiles), kNThreads, cs_bytes, stream>>>(p);
    PC_CUDA_LAUNCH_CHECK();
    return;
  }
  const size_t smem = cs_bytes + static_cast<size_t>(gpb) * 2 * D * sizeof(F);
  auto kern = qk_norm_kernel<T, VE, ALIGN, UPL, GPTJ, true, NK>;
  if (smem + sizeof(NBase) * kNMaxTok > 48 * 1024)
    PC_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int blocks = static_cast<int>(std::min<int64_t>(p.tiles, kNormBwdBlocks));
  kern<<<static_cast<unsigned>(blocks), kNThreads, smem, stream>>>(p);
  PC_CUDA_LAUNCH_CHECK();
  sum_partials<F>(static_cast<const F*>(a.workspace), blocks, D, a.dw_q, a.dw_k, a.dw_dtype, stream);
}

// Units per row -> (UPL, G): the smallest UPL of the instantiated ones (ascending) with U <= 32 * UPL, G the
// smallest power of two with G * UPL >= U.
template <typename T, int VE, int ALIGN, bool GPTJ, int NK, int... UPLS>
void launch_upl(const NormArgs& a, int U, int P, bool bwd, cudaStream_t stream) {
  PC_CHECK(((U <= 32 * UPLS) || ...), "qk_norm_rope_cuda: ", U, " units per row exceed the kernel's registers");
  dispatch_first<UPLS...>([&](int upl) { return U <= 32 * upl; },
                          [&](auto upl_c) {
                            constexpr int UPL = decltype(upl_c)::value;
                            int G = 1;
                            while (G * UPL < U) G <<= 1;
                            launch<T, VE, ALIGN, UPL, GPTJ, NK>(a, U, P, G, bwd, stream);
                          });
}

template <typename T, bool GPTJ>
void dispatch(const NormArgs& a, bool bwd, cudaStream_t stream) {
  const RopeArgs& r = a.r;
  const int64_t D = r.head_dim, rd = r.rotary_dim, n = rd / 2;
  auto fits = [&](int64_t ve, int bytes) {
    const void* ptrs[] = {r.q.in, r.q.out, r.k.in, r.k.out, bwd ? a.g_q.in : nullptr, bwd ? a.g_k.in : nullptr};
    for (const void* q : ptrs)
      if (!cuda::aligned(q, bytes)) return false;
    if (!strides_ok(r.q, ve) || !strides_ok(r.k, ve)) return false;
    if (bwd && (!strides_ok(a.g_q, ve) || !strides_ok(a.g_k, ve))) return false;
    return D % ve == 0 && (GPTJ ? rd : n) % ve == 0;
  };
  auto units = [&](int64_t ve, int& P) {
    P = static_cast<int>((GPTJ ? rd : n) / ve);
    return P + static_cast<int>((D - rd) / ve);
  };
  constexpr int S = sizeof(T);
  constexpr int VE16 = 16 / S;
  int P = 0;
  if (VE16 >= (GPTJ ? 2 : 1) && fits(VE16, 16)) {
    const int U = units(VE16, P);
    // head_dim <= 512: at most 512 / VE16 units (64 for 2-byte types, 128 for fp32, 256 for fp64)
    // the norm kind is a template argument on the vector path (no per-element select of the gain)
    return dispatch_bool(a.norm == kNormRms, [&](auto rms) {
      constexpr int NK = decltype(rms)::value ? kNormRms : kNormRmsOffset;
      if constexpr (S == 2 && !GPTJ) {
        if (qk_norm_wtok<T, NK>(a, bwd, stream)) return;
      }
      if constexpr (S == 8) launch_upl<T, VE16, 16, GPTJ, NK, 1, 4, 16>(a, U, P, bwd, stream);
      else launch_upl<T, VE16, 16, GPTJ, NK, 1, 4>(a, U, P, bwd, stream);
    });
  }
  constexpr int VE1 = GPTJ ? 2 : 1;  // element loads (a gptj pair is two elements; head_dim is even for gptj)
  const int U = units(VE1, P);
  launch_upl<T, VE1, S, GPTJ, -1, 4, 16>(a, U, P, bwd, stream);
}

template <typename T>
void by_style(const NormArgs& a, bool bwd, cudaStream_t stream) {
  dispatch_bool(a.r.gptj, [&](auto gptj) { dispatch<T, decltype(gptj)::value>(a, bwd, stream); });
}

void run(const NormArgs& a, bool bwd, cudaStream_t stream) {
  if (a.r.tokens == 0 || a.r.q.heads + a.r.k.heads == 0) return;
  PC_CHECK(a.r.head_dim <= kMaxNormHeadDim && a.r.rotary_dim >= 2 && a.r.rotary_dim <= a.r.head_dim,
           "qk_norm_rope_cuda: bad head_dim / rotary_dim ", a.r.head_dim, " / ", a.r.rotary_dim);
  dispatch_dtype(a.r.dtype, [&](auto tag) { by_style<decltype(tag)>(a, bwd, stream); });
}

}  // namespace

namespace detail {
template <typename F>
void sum_partials(const F* part, int nblocks, int D, void* dw_q, void* dw_k, DType w, cudaStream_t stream) {
  dispatch_dtype(w, [&](auto wt) {
    reduce_partials<F, decltype(wt)>
        <<<static_cast<unsigned>((2 * D + 31) / 32), kNThreads, 0, stream>>>(part, nblocks, D, dw_q, dw_k);
  });
  PC_CUDA_LAUNCH_CHECK();
}
template void sum_partials<float>(const float*, int, int, void*, void*, DType, cudaStream_t);
template void sum_partials<double>(const double*, int, int, void*, void*, DType, cudaStream_t);
}  // namespace detail

void cast_weights_cuda(const WeightsCast& a, cudaStream_t stream) {
  if (a.D == 0) return;
  dispatch_bool(a.acc == DType::F64, [&](auto f64) {
    using F = std::conditional_t<decltype(f64)::value, double, float>;
    dispatch_dtype(a.w, [&](auto wt) {
      cast_weights_kernel<decltype(wt), F>
          <<<static_cast<unsigned>((2 * a.D + kNThreads - 1) / kNThreads), kNThreads, 0, stream>>>(a);
    });
  });
  PC_CUDA_LAUNCH_CHECK();
}

void qk_norm_rope_cuda(const NormArgs& a, cudaStream_t stream) { run(a, false, stream); }

void qk_norm_rope_backward_cuda(const NormArgs& a, cudaStream_t stream) { run(a, true, stream); }

}  // namespace packcuda::rope
