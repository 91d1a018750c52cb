// Fused QK norm + rotation on the GPU, one warp per token: 2-byte types on the 16-byte vector path with neox
// pairs, head_dim 64, 128 or 256 and rotary_dim a multiple of 16 (the tile kernel, qk_norm_tile_cuda.cu, runs
// everything else and calls detail::qk_norm_wtok first).
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "rope/cuda/rope_cuda_common.cuh"

namespace packcuda::rope {
namespace {
using namespace detail;

// ---------------------------------------------------------------------------------------------------
// One warp per token: 2-byte types on the 16-byte vector path, neox pairs, head_dim D = 16 * L with L lanes per row
// dividing 32 (D = 64, 128, 256 instantiated), rotary_dim a multiple of 16, the shape taken at run time. The
// pieces below are those of the warp-per-token kernels:
//  - WTok, the lane and its warp's walk. A lane owns two 8-element vectors of a row: rotary lanes (r < P = n / 8)
//    the chunk at 8r and its partner n channels later, pass-through lanes (r >= P) the vector at rd + 8 (r - P)
//    and the one (D - rd) / 2 channels later. RW = 32 / L rows per warp step (row slot sub = lane / L): a warp
//    walks the q heads of its token RW at a time, then its k heads; a last step with fewer heads than RW idles
//    the other row slots (no loads, no stores, nothing summed; their lanes still take part in the shuffles).
//    Global warp gw takes tokens gw, gw + NW, gw + 2 NW, ... (NW warps in all); a cursor WCur names a step.
//  - wtok_walk: the steps of a warp, the loads of step s + A issued before the work of step s (a ring of A + 1
//    register buffers; the backward A = 1, the forward A = kWtokFwdAhead).
//  - wtok_table: at a token's first step the warp's lanes compute its cos/sin into the warp's table (the rotation
//    for the forward, its inverse for the backward), read back by wtok_rotate.
//  - the gains in shared memory (wtok_gains, wtok_gain16), the row sums (row_sum, wtok_rstd), the row addressing
//    (row_in, row_out) and the 16-byte loads and stores (load2, store2, unpack8, pack8).
// ---------------------------------------------------------------------------------------------------
constexpr int kWtokWarps = 8;            // warps per block
constexpr int kWtokBwdMinBlocks = 2;     // backward: blocks per SM the registers are bounded for
constexpr int kWtokBwdBlocks = 2 * 132;  // backward grid: two blocks on each of an H200's 132 SMs (fewer for few
                                         // tokens); a constant, not the device's count, so the order of the
                                         // weight-gradient sums depends on the shape only
static_assert(kWtokBwdBlocks <= kNormBwdBlocks, "the workspace holds kNormBwdBlocks partials");
constexpr int kWtokFwdAhead = 2;  // forward: steps whose loads are issued ahead of the math (A; a step
                                  // reads 1 KB per warp; the fastest of the variants, docs/design.md
                                  // "Look-ahead of the forward")
constexpr int kWtokFwdMinBlocks = 3;  // forward: blocks per SM the registers are bounded for (80 registers)

struct WParams {
  NormArgs a;
  int hq, hk;  // q heads, k heads
  int sq, steps;  // warp steps of a token over its q heads (ceil(hq / RW)) and over its q and k heads
  int n, P;  // rotary_dim / 2, rotary lanes of a row (n / 8)
  int64_t ntok;  // tokens
  int64_t nw_b, nw_s;  // NW tokens as a (batch, seq) step: NW / seq, NW % seq
};

// The parameters of a grid of `blocks` blocks of kWtokWarps warps (who: the caller, for the shape check).
template <int D>
WParams make_wparams(const NormArgs& a, int blocks, const char* who) {
  constexpr int RW = 32 / (D / 16);
  const RopeArgs& r = a.r;
  PC_CHECK(r.head_dim == D && r.rotary_dim % 16 == 0 && r.seq > 0, who, ": bad shape");
  WParams p;
  p.a = a;
  p.hq = static_cast<int>(r.q.heads);
  p.hk = static_cast<int>(r.k.heads);
  p.sq = (p.hq + RW - 1) / RW;
  p.steps = p.sq + (p.hk + RW - 1) / RW;
  p.n = static_cast<int>(r.rotary_dim / 2);
  p.P = p.n / 8;
  p.ntok = r.tokens;
  const int64_t nw = static_cast<int64_t>(blocks) * kWtokWarps;
  p.nw_b = nw / r.seq;
  p.nw_s = nw % r.seq;
  return p;
}

// A step of a warp: its ordinal i among its tokens, token t = gw + i * NW as (batch b, seq s), step st of the
// token (st < sq: q heads st * RW + sub, else k heads (st - sq) * RW + sub).
struct WCur {
  int64_t b, s;
  int i, st;
};

template <int D>
struct WTok {
  static constexpr int L = D / 16, RW = 32 / L;
  static_assert(D % 16 == 0 && 32 % L == 0 && (D & (D - 1)) == 0, "L = D / 16 lanes per row divide the warp");
  // the lane: warp of the block, lane of the warp, lane rl of its row slot sub, its vectors at lo0 and lo1
  int warp, lane, rl, sub, n, P, lo0, lo1;
  bool rot;
  // the walk: steps of a token (S, of them SQ over the q heads), heads, the warp's tokens (ntw)
  int S, SQ, hq, hk, ntw;
  int64_t gw, seq, nw_b, nw_s;

  __device__ __forceinline__ explicit WTok(const WParams& p) {
    warp = threadIdx.x >> 5;
    lane = threadIdx.x & 31;
    rl = lane % L;
    sub = lane / L;
    n = p.n;
    P = p.P;
    const int rd = 2 * n;
    rot = rl < P;
    lo0 = rot ? rl * 8 : rd + (rl - P) * 8;
    lo1 = rot ? lo0 + n : lo0 + (D - rd) / 2;
    S = p.steps;
    SQ = p.sq;
    hq = p.hq;
    hk = p.hk;
    gw = static_cast<int64_t>(blockIdx.x) * kWtokWarps + warp;
    const int64_t NW = static_cast<int64_t>(gridDim.x) * kWtokWarps;
    ntw = gw < p.ntok ? static_cast<int>((p.ntok - gw + NW - 1) / NW) : 0;
    seq = p.a.r.seq;
    nw_b = p.nw_b;
    nw_s = p.nw_s;
  }
  // the warp's first step
  __device__ __forceinline__ WCur first() const {
    const TokenIndex ti(gw, seq);
    WCur c;
    c.b = ti.b;
    c.s = ti.s;
    c.i = 0;
    c.st = 0;
    return c;
  }
  // the warp's next step: the token's next heads, or the first heads of its next token
  __device__ __forceinline__ void advance(WCur& c) const {
    if (++c.st == S) {
      c.st = 0;
      ++c.i;
      c.b += nw_b;
      c.s += nw_s;
      if (c.s >= seq) {
        c.s -= seq;
        ++c.b;
      }
    }
  }
  // head of this lane's row slot at step st, and whether the slot holds a row
  __device__ __forceinline__ int head_of(int st, bool& act) const {
    const bool isq = st < SQ;
    const int h = (isq ? st : st - SQ) * RW + sub;
    act = h < (isq ? hq : hk);
    return h;
  }
};

// Runs a warp's steps: issue(c, buf) issues the loads of step c into a buffer, step(buf, c) does its work. The
// loads of step s + A are issued before the work of step s, from a ring of A + 1 register buffers (the loop
// unrolled A + 1 times, so that the ring's indices are constants). Warp-uniform trip counts: every lane reaches
// every shuffle and __syncwarp of step.
template <int A, int D, typename B, typename Issue, typename Step>
__device__ __forceinline__ void wtok_walk(const WTok<D>& w, B (&buf)[A + 1], Issue&& issue, Step&& step) {
  static_assert(A >= 1, "loads one step ahead or more");
  const int ntw = w.ntw;
  WCur cur = w.first(), ld = cur;  // ld: the step of the next loads, A steps after cur
#pragma unroll
  for (int k = 0; k < A; ++k) {
    if (ld.i < ntw) issue(ld, buf[k]);
    w.advance(ld);
  }
  while (cur.i < ntw) {
#pragma unroll
    for (int j = 0; j <= A; ++j) {
      if (cur.i < ntw) {
        WCur nxt = cur;
        w.advance(nxt);
        if constexpr (A == 1) ld = nxt;  // one step ahead: the next step's loads
        if (ld.i < ntw) issue(ld, buf[(j + A) % (A + 1)]);
        step(buf[j], cur);
        cur = nxt;
        if constexpr (A > 1) w.advance(ld);
      }
    }
  }
}

// Head h of token c in the inputs / outputs of q (isq) or k (fields picked one by one: no dynamic reference
// into the kernel parameters).
template <typename T>
__device__ __forceinline__ const T* row_in(const HeadsView& q, const HeadsView& k, bool isq, const WCur& c, int h) {
  return static_cast<const T*>(isq ? q.in : k.in) +
         (c.b * (isq ? q.in_sb : k.in_sb) + c.s * (isq ? q.in_ss : k.in_ss) + h * (isq ? q.in_sh : k.in_sh));
}
template <typename T>
__device__ __forceinline__ T* row_out(const HeadsView& q, const HeadsView& k, bool isq, const WCur& c, int h) {
  return static_cast<T*>(isq ? q.out : k.out) +
         (c.b * (isq ? q.out_sb : k.out_sb) + c.s * (isq ? q.out_ss : k.out_ss) + h * (isq ? q.out_sh : k.out_sh));
}

// 8 elements of a 16-byte vector <-> fp32 (exact widening; rounding to nearest even when narrowing, as Elem).
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (std::is_same_v<T, bf16_t>) {
      f[2 * k] = __uint_as_float(w[k] << 16);
      f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    } else {
      __half2 h;
      memcpy(&h, &w[k], 4);
      const float2 v = __half22float2(h);
      f[2 * k] = v.x;
      f[2 * k + 1] = v.y;
    }
  }
}
template <typename T>
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (std::is_same_v<T, bf16_t>) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
      memcpy(&w[k], &h, 4);
    } else {
      const __half2 h = __floats2half2_rn(f[2 * k], f[2 * k + 1]);
      memcpy(&w[k], &h, 4);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// A lane's two vectors of a row: read-only loads (in place, a row is read before it is written, by the lanes
// that write it, and never read again) and stores of 16 values.
template <typename T>
__device__ __forceinline__ void load2(const T* row, int lo0, int lo1, uint4* b) {
  b[0] = __ldg(reinterpret_cast<const uint4*>(row + lo0));
  b[1] = __ldg(reinterpret_cast<const uint4*>(row + lo1));
}
template <typename T>
__device__ __forceinline__ void store2(T* row, int lo0, int lo1, const float* o) {
  *reinterpret_cast<uint4*>(row + lo0) = pack8<T>(o);
  *reinterpret_cast<uint4*>(row + lo1) = pack8<T>(o + 8);
}

// The gains of q and k, gsm[0] and gsm[1]: w (rms) or 1 + w (rms_offset); block-wide, then a barrier.
template <int D, int NK>
__device__ __forceinline__ void wtok_gains(float (&gsm)[2][D], const NormArgs& a) {
  for (int c = threadIdx.x; c < 2 * D; c += kWtokWarps * 32) {
    const float w = c < D ? static_cast<const float*>(a.w_q)[c] : static_cast<const float*>(a.w_k)[c - D];
    gsm[c / D][c % D] = norm_gain(w, NK);
  }
  __syncthreads();
}
// The gains of a lane's 16 channels (g: one row of gsm).
__device__ __forceinline__ void wtok_gain16(const float* g, int lo0, int lo1, float* gn) {
  const float4* g0 = reinterpret_cast<const float4*>(g + lo0);
  const float4* g1 = reinterpret_cast<const float4*>(g + lo1);
  const float4 t4[4] = {g0[0], g0[1], g1[0], g1[1]};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    gn[4 * q] = t4[q].x;
    gn[4 * q + 1] = t4[q].y;
    gn[4 * q + 2] = t4[q].z;
    gn[4 * q + 3] = t4[q].w;
  }
}

// Sum over the L lanes of a row slot (xor butterfly: every lane ends with the same bits).
template <int L>
__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int off = L / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
// rstd of a row from the lanes' 16 values each (summed in element order, then over the row's lanes); an idle
// row slot (act false, zeros) gets 0, so that nothing of it is summed anywhere even with eps = 0.
template <int D>
__device__ __forceinline__ float wtok_rstd(const float* x, float eps, bool act) {
  constexpr float d_inv = 1.f / static_cast<float>(D);  // D a power of two: v * d_inv == v / D
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < 16; ++e) ss += x[e] * x[e];
  ss = row_sum<D / 16>(ss);
  return act ? norm_rstd_of_var(ss * d_inv, eps) : 0.f;
}

// cos/sin of token c's n slots into a warp's table tab (the rotation, or its inverse for the backward): entry
// e holds slot j = u * 8 + 2 * mp + (e & 1) with (mp, u) = ((e / 2) / P, (e / 2) % P), so that the rotary lanes
// (consecutive u) read consecutive 16-byte pairs (the tile kernel's layout of a token). Warp-wide (warp-uniform
// control flow): the previous token's reads are done before, the entries visible to the warp after.
__device__ __forceinline__ void wtok_table(CosSin<float>* tab, const RopeArgs& r, const WCur& c, int n, int P, int lane,
                                           bool inverse) {
  const float scaling = static_cast<float>(r.scaling);
  const int64_t pb = c.b * r.pos_sb + c.s * r.pos_ss;
  __syncwarp();
  for (int e = lane; e < n; e += 32) {
    const int q2 = e >> 1, mp = q2 / P, u = q2 - mp * P;
    const int j = u * 8 + 2 * mp + (e & 1);
    const int ax = slot_axis(j, r.layout, r.section[0], r.section[1], r.section[2]);
    const int64_t off = ax * r.pos_row_stride + pb;
    const int64_t pos =
        r.pos_int64 ? __ldg(static_cast<const long long*>(r.pos) + off) : __ldg(static_cast<const int*>(r.pos) + off);
    CosSin<float> w;
    rope_cos_sin(rope_angle(pos, __ldg(r.inv_freq + j)), scaling, inverse, &w.c, &w.s);
    tab[e] = w;
  }
  __syncwarp();
}
// Rotates a rotary lane's 8 pairs (v[m], v[8 + m]) by its entries of the token's table (rotary lane rl).
__device__ __forceinline__ void wtok_rotate(const CosSin<float>* tab, int P, int rl, float* v) {
  const CosSin2<float>* c2 = reinterpret_cast<const CosSin2<float>*>(tab);
#pragma unroll
  for (int mp = 0; mp < 4; ++mp) {
    const CosSin2<float> cw = c2[mp * P + rl];
    rotate_pair<float>(v[2 * mp], v[8 + 2 * mp], cw.a.c, cw.a.s, &v[2 * mp], &v[8 + 2 * mp]);
    rotate_pair<float>(v[2 * mp + 1], v[9 + 2 * mp], cw.b.c, cw.b.s, &v[2 * mp + 1], &v[9 + 2 * mp]);
  }
}

// ---------------------------------------------------------------------------------------------------
// Backward, one warp per token (the fastest structure measured, docs/design.md "Why one warp per token": one row of
// loads ahead and a per-warp cos/sin table): a step reads x and the gradient of its rows, two
// vectors each, one step ahead, and writes dx; the table holds the inverse rotation. The weight gradients stay
// in registers over all of the warp's tokens; at the end an xor butterfly over the row slots, then the block's
// warps summed in warp order (shared memory) into its [2, D] partial, and sum_partials sums the partials in
// block order. Fixed orders throughout, no atomics. The math and its rounding points are the tile kernel's
// (qk_norm_kernel, BWD); the order of the sums differs.
// ---------------------------------------------------------------------------------------------------
template <typename T, int D, int NK>
__global__ void __launch_bounds__(kWtokWarps * 32, kWtokBwdMinBlocks) qk_norm_bwd_wtok_kernel(const WParams p) {
  using W = WTok<D>;
  constexpr int L = W::L, WPB = kWtokWarps;
  constexpr float d_inv = 1.f / static_cast<float>(D);  // D a power of two: v * d_inv == v / D
  constexpr unsigned kFull = 0xffffffffu;
  const NormArgs& a = p.a;
  const RopeArgs& r = a.r;
  __shared__ __align__(16) float gsm[2][D];  // gains of q, k: w (rms) or 1 + w (rms_offset)
  __shared__ __align__(16) float red[WPB][2][D];  // the warps' weight-gradient sums
  __shared__ __align__(16) CosSin<float> cst[WPB][D / 2];  // each warp's cos/sin of its current token
  const W w(p);
  const float eps = static_cast<float>(a.eps);
  auto round = [](float v) { return Elem<T>::load(Elem<T>::store(v)); };
  wtok_gains<D, NK>(gsm, a);

  // the step's loads: x and the gradient, two vectors each (zeros for an idle row slot)
  auto issue = [&](const WCur& c, uint4(&b)[4]) {
    bool act;
    const int h = w.head_of(c.st, act);
    if (act) {
      const bool isq = c.st < w.SQ;
      load2(row_in<T>(r.q, r.k, isq, c, h), w.lo0, w.lo1, b);
      load2(row_in<T>(a.g_q, a.g_k, isq, c, h), w.lo0, w.lo1, b + 2);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) b[k] = make_uint4(0u, 0u, 0u, 0u);
    }
  };

  float acc[2][16];
#pragma unroll
  for (int ph = 0; ph < 2; ++ph)
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[ph][e] = 0.f;

  // one row per row slot: gn = R(-a) g on the rotary pairs; dxh = gn * gain, dot = sum(dxh * xhat),
  // dx = rstd * (dxh - xhat * dot / D); acc += gn * xhat (rounded to T for rms)
  auto math = [&](const uint4(&b)[4], const WCur& c, auto ph_c) {
    constexpr int PH = decltype(ph_c)::value;
    bool act;
    const int h = w.head_of(c.st, act);
    float x[16], g[16];
    unpack8<T>(b[0], x);
    unpack8<T>(b[1], x + 8);
    unpack8<T>(b[2], g);
    unpack8<T>(b[3], g + 8);
    const float rstd = wtok_rstd<D>(x, eps, act);
    if (w.rot) wtok_rotate(&cst[w.warp][0], w.P, w.rl, g);
    float gn[16];
    wtok_gain16(&gsm[PH][0], w.lo0, w.lo1, gn);
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const float xh = norm_xhat(x[e], rstd, NK, round);
      acc[PH][e] += g[e] * xh;
      g[e] *= gn[e];  // dxh
      dot += g[e] * (x[e] * rstd);
    }
    dot = row_sum<L>(dot);
    const float dot_d = dot * d_inv;
    if (act) {
      float o[16];
#pragma unroll
      for (int e = 0; e < 16; ++e) o[e] = norm_dx_of(g[e], x[e], rstd, dot_d);
      store2(row_out<T>(r.q, r.k, PH == 0, c, h), w.lo0, w.lo1, o);
    }
  };

  uint4 buf[2][4];
  wtok_walk<1>(w, buf, issue, [&](const uint4(&b)[4], const WCur& c) {
    if (c.st == 0) wtok_table(&cst[w.warp][0], r, c, w.n, w.P, w.lane, true);
    if (c.st < w.SQ) math(b, c, std::integral_constant<int, 0>{});
    else math(b, c, std::integral_constant<int, 1>{});
  });

  // the warp's sums: xor butterfly over its row slots, then the block's warps in order
#pragma unroll
  for (int off = L; off < 32; off <<= 1)
#pragma unroll
    for (int ph = 0; ph < 2; ++ph)
#pragma unroll
      for (int e = 0; e < 16; ++e) acc[ph][e] += __shfl_xor_sync(kFull, acc[ph][e], off);
  if (w.sub == 0) {
#pragma unroll
    for (int ph = 0; ph < 2; ++ph) {
      float4* d0 = reinterpret_cast<float4*>(&red[w.warp][ph][w.lo0]);
      float4* d1 = reinterpret_cast<float4*>(&red[w.warp][ph][w.lo1]);
      d0[0] = make_float4(acc[ph][0], acc[ph][1], acc[ph][2], acc[ph][3]);
      d0[1] = make_float4(acc[ph][4], acc[ph][5], acc[ph][6], acc[ph][7]);
      d1[0] = make_float4(acc[ph][8], acc[ph][9], acc[ph][10], acc[ph][11]);
      d1[1] = make_float4(acc[ph][12], acc[ph][13], acc[ph][14], acc[ph][15]);
    }
  }
  __syncthreads();
  float* part = static_cast<float*>(a.workspace) + static_cast<int64_t>(blockIdx.x) * 2 * D;
  for (int c = threadIdx.x; c < 2 * D; c += WPB * 32) {
    float s = 0.f;
#pragma unroll
    for (int wi = 0; wi < WPB; ++wi) s += red[wi][c / D][c % D];
    part[c] = s;
  }
}

template <typename T, int D, int NK>
void launch_wtok_bwd(const NormArgs& a, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>(kWtokBwdBlocks, (a.r.tokens + kWtokWarps - 1) / kWtokWarps));
  const WParams p = make_wparams<D>(a, blocks, "qk_norm_rope_backward_cuda");
  qk_norm_bwd_wtok_kernel<T, D, NK><<<static_cast<unsigned>(blocks), kWtokWarps * 32, 0, stream>>>(p);
  PC_CUDA_LAUNCH_CHECK();
  sum_partials<float>(static_cast<const float*>(a.workspace), blocks, D, a.dw_q, a.dw_k, a.dw_dtype, stream);
}

// ---------------------------------------------------------------------------------------------------
// Forward, one warp per token (the fastest structure measured, docs/design.md "Why one warp per token":
// loads issued steps ahead into a ring of registers, a grid of one wave of resident blocks; with the lane layout
// and the per-warp cos/sin table above): a step reads x of its rows, two vectors per lane, kWtokFwdAhead steps
// ahead, and writes y = R(a) (gain * xhat) on the rotary pairs, gain * xhat on the pass-through channels, xhat =
// x * rstd (rounded to T for rms). In place (in == out, possibly strided views of one buffer) every row is read
// before it is written, by the lanes that write it. The math and its rounding points are the tile kernel's
// (qk_norm_kernel, forward); the order of the row's sum of squares differs (fixed: wtok_rstd).
// ---------------------------------------------------------------------------------------------------
template <typename T, int D, int NK>
__global__ void __launch_bounds__(kWtokWarps * 32, kWtokFwdMinBlocks) qk_norm_fwd_wtok_kernel(const WParams p) {
  constexpr int A = kWtokFwdAhead;
  const NormArgs& a = p.a;
  const RopeArgs& r = a.r;
  __shared__ __align__(16) float gsm[2][D];  // gains of q, k: w (rms) or 1 + w (rms_offset)
  __shared__ __align__(16) CosSin<float> cst[kWtokWarps][D / 2];  // each warp's cos/sin of its current token
  const WTok<D> w(p);
  const float eps = static_cast<float>(a.eps);
  auto round = [](float v) { return Elem<T>::load(Elem<T>::store(v)); };
  wtok_gains<D, NK>(gsm, a);

  // the step's loads: x, two vectors (zeros for an idle row slot)
  auto issue = [&](const WCur& c, uint4(&b)[2]) {
    bool act;
    const int h = w.head_of(c.st, act);
    if (act) {
      load2(row_in<T>(r.q, r.k, c.st < w.SQ, c, h), w.lo0, w.lo1, b);
    } else {
      b[0] = make_uint4(0u, 0u, 0u, 0u);
      b[1] = make_uint4(0u, 0u, 0u, 0u);
    }
  };
  // one row per row slot
  auto step = [&](const uint4(&b)[2], const WCur& c) {
    if (c.st == 0) wtok_table(&cst[w.warp][0], r, c, w.n, w.P, w.lane, false);
    bool act;
    const int h = w.head_of(c.st, act);
    const bool isq = c.st < w.SQ;
    float x[16];
    unpack8<T>(b[0], x);
    unpack8<T>(b[1], x + 8);
    const float rstd = wtok_rstd<D>(x, eps, act);
    float gn[16];
    wtok_gain16(&gsm[isq ? 0 : 1][0], w.lo0, w.lo1, gn);
#pragma unroll
    for (int e = 0; e < 16; ++e) x[e] = gn[e] * norm_xhat(x[e], rstd, NK, round);
    if (w.rot) wtok_rotate(&cst[w.warp][0], w.P, w.rl, x);
    if (act) store2(row_out<T>(r.q, r.k, isq, c, h), w.lo0, w.lo1, x);
  };

  uint4 buf[A + 1][2];
  wtok_walk<A>(w, buf, issue, step);
}

// Blocks per SM of a kernel of kWtokWarps warps without dynamic shared memory.
template <typename Kernel>
int wtok_blocks_per_sm(Kernel k) {
  int n = 0;
  PC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, kWtokWarps * 32, 0));
  return n > 0 ? n : 1;
}

// The forward has no partials: its grid is one wave of resident blocks (fewer for few tokens).
template <typename T, int D, int NK>
void launch_wtok_fwd(const NormArgs& a, cudaStream_t stream) {
  auto kern = qk_norm_fwd_wtok_kernel<T, D, NK>;
  static const int occ = wtok_blocks_per_sm(kern);
  const int64_t wave = static_cast<int64_t>(cuda::sm_count()) * occ;
  const int blocks = static_cast<int>(std::min<int64_t>(wave, (a.r.tokens + kWtokWarps - 1) / kWtokWarps));
  const WParams p = make_wparams<D>(a, blocks, "qk_norm_rope_cuda");
  kern<<<static_cast<unsigned>(blocks), kWtokWarps * 32, 0, stream>>>(p);
  PC_CUDA_LAUNCH_CHECK();
}

}  // namespace

namespace detail {
template <typename T, int NK>
bool qk_norm_wtok(const NormArgs& a, bool bwd, cudaStream_t stream) {
  if (a.r.rotary_dim % 16 != 0) return false;
  return dispatch_one_of<64, 128, 256>(a.r.head_dim, [&](auto d_c) {
    constexpr int D = decltype(d_c)::value;
    if (bwd) launch_wtok_bwd<T, D, NK>(a, stream);
    else launch_wtok_fwd<T, D, NK>(a, stream);
  });
}
template bool qk_norm_wtok<bf16_t, kNormRms>(const NormArgs&, bool, cudaStream_t);
template bool qk_norm_wtok<bf16_t, kNormRmsOffset>(const NormArgs&, bool, cudaStream_t);
template bool qk_norm_wtok<f16_t, kNormRms>(const NormArgs&, bool, cudaStream_t);
template bool qk_norm_wtok<f16_t, kNormRmsOffset>(const NormArgs&, bool, cudaStream_t);
}  // namespace detail

}  // namespace packcuda::rope
