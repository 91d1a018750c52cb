// qk_norm_rope_bwd_structures: microbenchmark of BACKWARD kernel structures for fused per-head QK-RMSNorm + neox rotary (bf16),
// with multimodal rotary (mRoPE, "interleaved" as transformers' Qwen3-VL apply_interleaved_mrope): positions
// int64 pos[3][T] (rows t, h, w); slot j uses row slot_axis(j) (h if j%3==1 && j<3*s1, w if j%3==2 && j<3*s2,
// else t).
// Self-contained. Build: nvcc -O3 -std=c++17 -arch=sm_90 -o qk_bwd qk_norm_rope_bwd_structures.cu
// Run: ./qk_bwd         (all shapes; about 10-20 s on an H200, < 25 GB of GPU memory)
//
// Backward per row x (saved input), dy (grad of out):
//   gn = R(-a) dy on rotary pairs, dy elsewhere; rstd = 1/sqrt(mean(x^2)+eps); xhat = x*rstd
//   dw[c] += gn[c] * xh[c]  (xh = bf16(xhat) for rms, xhat for rms_offset)
//   dxhat = gn*gain (gain = w or 1+w); dot = sum dxhat*xhat; dx = rstd*(dxhat - xhat*dot/D)
// Weight gradients: per-block partials [blocks][2][D] (fixed order), then reduce_partials sums blocks in order.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <vector>
#include <algorithm>
#include <string>
#include <functional>
#include <type_traits>

#define CK(x)                                                                                         \
  do {                                                                                                \
    cudaError_t e_ = (x);                                                                             \
    if (e_ != cudaSuccess) {                                                                          \
      fprintf(stderr, "CUDA error '%s' at %s:%d: %s\n", #x, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                                                        \
    }                                                                                                 \
  } while (0)
#define CKL() CK(cudaGetLastError())

enum { kRms = 0, kRmsOffset = 1 };
constexpr int kThreads = 256;

struct Args {
  const uint16_t* xq;
  const uint16_t* xk;
  const uint16_t* gq;  // dy of q
  const uint16_t* gk;
  uint16_t* dxq;
  uint16_t* dxk;
  const float* wq;
  const float* wk;
  const float* inv_freq;  // [rd/2]
  const long long* pos;   // [3][T] (t, h, w rows, row stride T)
  float* part;            // [blocks][2][D]
  int T, hq, hk, D, rd;
  int sec1, sec2;         // mRoPE sections s1, s2 (s0 = rd/2 - s1 - s2 implied)
  float eps;
};

// ------------------------------------------------------------------------------------------------
// helpers
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  f[0] = bf_lo(v.x); f[1] = bf_hi(v.x); f[2] = bf_lo(v.y); f[3] = bf_hi(v.y);
  f[4] = bf_lo(v.z); f[5] = bf_hi(v.z); f[6] = bf_lo(v.w); f[7] = bf_hi(v.w);
}
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint4 pack8(const float* f) {
  return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}
__device__ __forceinline__ float bf_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float bf2f(uint16_t u) { return __uint_as_float(static_cast<uint32_t>(u) << 16); }
__device__ __forceinline__ uint16_t f2bf(float v) {
  __nv_bfloat16 h = __float2bfloat16_rn(v);
  return *reinterpret_cast<uint16_t*>(&h);
}
__device__ __forceinline__ uint4 ldg16(const uint16_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ void st16(uint16_t* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }
__device__ __forceinline__ float rstd_of(float ss, float d_inv, float eps) {
  return 1.0f / sqrtf(ss * d_inv + eps);  // IEEE sqrt and division, as the library
}
// mRoPE interleaved (transformers Qwen3-VL apply_interleaved_mrope): position row of frequency slot j
__device__ __forceinline__ int slot_axis(int j, int s1, int s2) {
  const int r = j % 3;
  return (r == 1 && j < 3 * s1) ? 1 : ((r == 2 && j < 3 * s2) ? 2 : 0);
}
template <typename V>
__device__ __forceinline__ V pick3(int ax, V v0, V v1, V v2) { return ax == 1 ? v1 : (ax == 2 ? v2 : v0); }
// inverse rotation (backward): (c, s) = (cos a, -sin a) stored; gn0 = d0 c - d1 s', gn1 = d1 c + d0 s' with s' = -sin
__device__ __forceinline__ void rot_back(float d0, float d1, float c, float s, float* o0, float* o1) {
  // s here is sin(a): gn0 = d0 c + d1 s, gn1 = d1 c - d0 s
  *o0 = fmaf(d0, c, __fmul_rn(d1, s));
  *o1 = fmaf(d1, c, -__fmul_rn(d0, s));
}

// dw[c] = sum over blocks b (in order) of part[b][c]; fixed order (warp w sums b = w, w+8, ..., then warps in order)
__global__ void __launch_bounds__(kThreads) reduce_partials(const float* part, int nblocks, int D, float* dw_q,
                                                            float* dw_k) {
  __shared__ float red[kThreads / 32][32];
  const int warp = threadIdx.x / 32, wl = threadIdx.x % 32;
  const int c = blockIdx.x * 32 + wl;
  const int C = 2 * D;
  float s = 0.f;
  if (c < C)
    for (int b = warp; b < nblocks; b += kThreads / 32) s += part[static_cast<int64_t>(b) * C + c];
  red[warp][wl] = s;
  __syncthreads();
  if (warp == 0 && c < C) {
    float t = 0.f;
    for (int wi = 0; wi < kThreads / 32; ++wi) t += red[wi][wl];
    if (c < D) dw_q[c] = t;
    else dw_k[c - D] = t;
  }
}

// ------------------------------------------------------------------------------------------------
// reference: one thread per row; contrib[row][c] = gn*xh (fp32), summed by ref_dw_chunks + ref_dw_final
// ------------------------------------------------------------------------------------------------
__global__ void ref_rows(const Args a, int kind, float* contrib) {
  const int64_t rq = static_cast<int64_t>(a.T) * a.hq, rk = static_cast<int64_t>(a.T) * a.hk;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rq + rk) return;
  const bool isq = row < rq;
  const int64_t rr = isq ? row : row - rq;
  const int H = isq ? a.hq : a.hk;
  const int t = static_cast<int>(rr / H);
  const uint16_t* x = (isq ? a.xq : a.xk) + rr * a.D;
  const uint16_t* g = (isq ? a.gq : a.gk) + rr * a.D;
  uint16_t* y = (isq ? a.dxq : a.dxk) + rr * a.D;
  const float* w = isq ? a.wq : a.wk;
  const int D = a.D, n = a.rd / 2;
  const float p0 = static_cast<float>(a.pos[t]);
  const float p1 = static_cast<float>(a.pos[static_cast<int64_t>(a.T) + t]);
  const float p2 = static_cast<float>(a.pos[2 * static_cast<int64_t>(a.T) + t]);
  float ss = 0.f;
  for (int c = 0; c < D; ++c) {
    const float v = bf2f(x[c]);
    ss += v * v;
  }
  const float rstd = 1.0f / sqrtf(ss / static_cast<float>(D) + a.eps);
  auto gn_of = [&](int c) {
    const float d = bf2f(g[c]);
    if (c >= a.rd) return d;
    const int j = c < n ? c : c - n;
    float sn, cs;
    sincosf(pick3(slot_axis(j, a.sec1, a.sec2), p0, p1, p2) * a.inv_freq[j], &sn, &cs);
    float o0, o1;
    if (c < n) {
      rot_back(d, bf2f(g[c + n]), cs, sn, &o0, &o1);
      return o0;
    }
    rot_back(bf2f(g[c - n]), d, cs, sn, &o0, &o1);
    return o1;
  };
  float dot = 0.f;
  for (int c = 0; c < D; ++c) {
    const float gn = gn_of(c);
    const float xhat = bf2f(x[c]) * rstd;
    const float xh = kind == kRms ? bf_round(xhat) : xhat;
    contrib[row * D + c] = gn * xh;
    const float gain = kind == kRms ? w[c] : 1.f + w[c];
    dot += gn * gain * xhat;
  }
  const float dd = dot / static_cast<float>(D);
  for (int c = 0; c < D; ++c) {
    const float gn = gn_of(c);
    const float xhat = bf2f(x[c]) * rstd;
    const float gain = kind == kRms ? w[c] : 1.f + w[c];
    y[c] = f2bf(rstd * (gn * gain - xhat * dd));
  }
}
// block b: rows [b*chunk, (b+1)*chunk) of q (part 0) and of k (part 1), summed in row order per channel
__global__ void ref_dw_chunks(const float* contrib, int64_t rq, int64_t rk, int D, int nch, float* part) {
  const int b = blockIdx.x;
  for (int ph = 0; ph < 2; ++ph) {
    const int64_t rows = ph == 0 ? rq : rk, off = ph == 0 ? 0 : rq;
    const int64_t chunk = (rows + nch - 1) / nch;
    const int64_t r0 = b * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
      float s = 0.f;
      for (int64_t r = r0; r < r1; ++r) s += contrib[(off + r) * D + c];
      part[(static_cast<int64_t>(b) * 2 + ph) * D + c] = s;
    }
  }
}
__global__ void ref_dw_final(const float* part, int nch, int D, float* dwq, float* dwk) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= 2 * D) return;
  const int ph = c / D, cc = c % D;
  float s = 0.f;
  for (int b = 0; b < nch; ++b) s += part[(static_cast<int64_t>(b) * 2 + ph) * D + cc];
  (ph == 0 ? dwq : dwk)[cc] = s;
}

// ------------------------------------------------------------------------------------------------
// baseline: the library's structure (runtime dims): 256 threads, groups of G lanes per row, units of one
// rotary vector pair (lo, lo+n) or one pass-through vector (UPL units per lane), cos/sin table of a tile in
// shared memory, q rows then k rows of the tile, dw partials in registers flushed per tile per phase into a
// per-group slot in shared memory, groups summed in order at the end. R rows per group per iteration
// (R = 1: the library; R > 1: all R rows' 16-byte loads issued before the math).
// ------------------------------------------------------------------------------------------------
struct BP {
  int n, P, U, G, hq, H, tok, cs_bytes;
  int dq[2], dr[2];
  int tiles;
};

__device__ __forceinline__ float group_sum(float v, int G) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    if (off < G) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <int KIND, int UPL, int R>
__global__ void __launch_bounds__(kThreads, (UPL == 1 && R == 1) ? 2 : 1) base_kernel(const Args a, const BP p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float2* cs = reinterpret_cast<float2*>(smem_raw);  // [tok][n] (cos, sin), slot layout as the library
  float* wacc = reinterpret_cast<float*>(smem_raw + p.cs_bytes);  // [groups][2][D]
  __shared__ long long tpos[3][32];  // [t, h, w row][local token]
  const int G = p.G, n = p.n, P = p.P, U = p.U, hq = p.hq, H = p.H;
  const int D = a.D, rd = a.rd;
  const int lane = threadIdx.x % G, grp = threadIdx.x / G, gpb = kThreads / G;
  const float d_inv = 1.f / static_cast<float>(D);
  auto unit_lo = [&](int u) { return u < P ? u * 8 : rd + (u - P) * 8; };

  float acc[UPL][2][8];
#pragma unroll
  for (int i = 0; i < UPL; ++i)
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
      for (int m = 0; m < 8; ++m) acc[i][s][m] = 0.f;
  for (int c = threadIdx.x; c < gpb * 2 * D; c += kThreads) wacc[c] = 0.f;

  for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const int t0 = tile * p.tok;
    const int ntok = min(p.tok, a.T - t0);
    __syncthreads();
    for (int tl = threadIdx.x; tl < ntok; tl += kThreads)
#pragma unroll
      for (int ax = 0; ax < 3; ++ax) tpos[ax][tl] = __ldg(a.pos + static_cast<int64_t>(ax) * a.T + t0 + tl);
    __syncthreads();
    for (int i = threadIdx.x; i < ntok * n; i += kThreads) {
      const int tl = i / n, e = i - tl * n;
      const int q2 = e >> 1, mp = q2 / P, u = q2 - mp * P;
      const int j = u * 8 + 2 * mp + (e & 1);
      float sn, c;
      sincosf(static_cast<float>(tpos[slot_axis(j, a.sec1, a.sec2)][tl]) * __ldg(a.inv_freq + j), &sn, &c);
      cs[i] = make_float2(c, sn);
    }
    __syncthreads();

#pragma unroll 1
    for (int ph = 0; ph < 2; ++ph) {
      const bool is_q = ph == 0;
      const int Hp = is_q ? hq : H - hq;
      const int rows = ntok * Hp;
      const float* w = is_q ? a.wq : a.wk;
      const uint16_t* X = is_q ? a.xq : a.xk;
      const uint16_t* Gd = is_q ? a.gq : a.gk;
      uint16_t* Y = is_q ? a.dxq : a.dxk;
      const int dq = p.dq[ph], dr = p.dr[ph];
      int ctl = grp / Hp;
      int chh = grp - ctl * Hp;
      for (int rb = 0; rb < rows; rb += gpb * R) {
        int tlr[R];
        bool act[R];
        int64_t roff[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          act[r] = ctl < ntok;
          tlr[r] = act[r] ? ctl : 0;
          const int hh = act[r] ? chh : 0;
          roff[r] = (static_cast<int64_t>(t0 + tlr[r]) * Hp + hh) * D;
          chh += dr;
          ctl += dq;
          if (chh >= Hp) {
            chh -= Hp;
            ++ctl;
          }
        }
        uint4 xv[R][UPL][2], gv[R][UPL][2];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int i = 0; i < UPL; ++i) {
            const int u = lane + i * G;
            const bool ok = act[r] && u < U;
            const bool pair = u < P;
            const int lo = unit_lo(u);
#pragma unroll
            for (int s = 0; s < 2; ++s) {
              const bool ld = ok && (s == 0 || pair);
              const int c = s == 0 ? lo : lo + n;
              xv[r][i][s] = ld ? ldg16(X + roff[r] + c) : make_uint4(0, 0, 0, 0);
              gv[r][i][s] = ld ? ldg16(Gd + roff[r] + c) : make_uint4(0, 0, 0, 0);
            }
          }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float ss = 0.f;
#pragma unroll
          for (int i = 0; i < UPL; ++i)
#pragma unroll
            for (int s = 0; s < 2; ++s) {
              float f[8];
              unpack8(xv[r][i][s], f);
#pragma unroll
              for (int m = 0; m < 8; ++m) ss += f[m] * f[m];
            }
          ss = group_sum(ss, G);
          const float rstd = rstd_of(ss, d_inv, a.eps);
          const float4* c2 = reinterpret_cast<const float4*>(cs + tlr[r] * n);
          float dot = 0.f;
          float g[UPL][2][8];
#pragma unroll
          for (int i = 0; i < UPL; ++i) {
            const int u = lane + i * G;
            const bool ok = act[r] && u < U;
            const bool rot = u < P;
            const int lo = unit_lo(u);
            float w0[8], w1[8];
            float4 t4[4];
            if (ok) {
              t4[0] = __ldg(reinterpret_cast<const float4*>(w + lo));
              t4[1] = __ldg(reinterpret_cast<const float4*>(w + lo + 4));
            }
            if (ok && rot) {
              t4[2] = __ldg(reinterpret_cast<const float4*>(w + lo + n));
              t4[3] = __ldg(reinterpret_cast<const float4*>(w + lo + n + 4));
            } else {
              t4[2] = t4[3] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
            if (!ok) t4[0] = t4[1] = make_float4(0.f, 0.f, 0.f, 0.f);
            w0[0] = t4[0].x; w0[1] = t4[0].y; w0[2] = t4[0].z; w0[3] = t4[0].w;
            w0[4] = t4[1].x; w0[5] = t4[1].y; w0[6] = t4[1].z; w0[7] = t4[1].w;
            w1[0] = t4[2].x; w1[1] = t4[2].y; w1[2] = t4[2].z; w1[3] = t4[2].w;
            w1[4] = t4[3].x; w1[5] = t4[3].y; w1[6] = t4[3].z; w1[7] = t4[3].w;
            float x0[8], x1[8];
            unpack8(xv[r][i][0], x0);
            unpack8(xv[r][i][1], x1);
            unpack8(gv[r][i][0], g[i][0]);
            unpack8(gv[r][i][1], g[i][1]);
            if (ok && rot) {
#pragma unroll
              for (int mp = 0; mp < 4; ++mp) {
                const float4 cw = c2[mp * P + u];
                rot_back(g[i][0][2 * mp], g[i][1][2 * mp], cw.x, cw.y, &g[i][0][2 * mp], &g[i][1][2 * mp]);
                rot_back(g[i][0][2 * mp + 1], g[i][1][2 * mp + 1], cw.z, cw.w, &g[i][0][2 * mp + 1],
                         &g[i][1][2 * mp + 1]);
              }
            }
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
              for (int m = 0; m < 8; ++m) {
                const bool live = ok && (s == 0 || rot);
                const float xhat = (s == 0 ? x0[m] : x1[m]) * rstd;
                const float xh = KIND == kRms ? bf_round(xhat) : xhat;
                const float wv = s == 0 ? w0[m] : w1[m];
                const float gain = KIND == kRms ? wv : 1.f + wv;
                acc[i][s][m] += live ? g[i][s][m] * xh : 0.f;
                g[i][s][m] = live ? g[i][s][m] * gain : 0.f;
                dot += g[i][s][m] * xhat;
              }
          }
          dot = group_sum(dot, G);
          const float dd = dot * d_inv;
#pragma unroll
          for (int i = 0; i < UPL; ++i) {
            const int u = lane + i * G;
            if (!(act[r] && u < U)) continue;
            const bool pair = u < P;
            const int lo = unit_lo(u);
#pragma unroll
            for (int s = 0; s < 2; ++s) {
              if (s == 1 && !pair) continue;
              float xf[8], o[8];
              unpack8(xv[r][i][s], xf);
#pragma unroll
              for (int m = 0; m < 8; ++m) o[m] = rstd * (g[i][s][m] - (xf[m] * rstd) * dd);
              st16(Y + roff[r] + (s == 0 ? lo : lo + n), pack8(o));
            }
          }
        }
      }
      // flush this phase's partials into the group's slot
#pragma unroll
      for (int i = 0; i < UPL; ++i) {
        const int u = lane + i * G;
        const bool pair = u < P;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          if (u < U && (s == 0 || pair)) {
            float4* slot = reinterpret_cast<float4*>(wacc + (grp * 2 + ph) * D + (s == 0 ? unit_lo(u) : unit_lo(u) + n));
            float4 v0 = slot[0], v1 = slot[1];
            v0.x += acc[i][s][0]; v0.y += acc[i][s][1]; v0.z += acc[i][s][2]; v0.w += acc[i][s][3];
            v1.x += acc[i][s][4]; v1.y += acc[i][s][5]; v1.z += acc[i][s][6]; v1.w += acc[i][s][7];
            slot[0] = v0;
            slot[1] = v1;
          }
#pragma unroll
          for (int m = 0; m < 8; ++m) acc[i][s][m] = 0.f;
        }
      }
    }
  }
  __syncthreads();
  float* part = a.part + static_cast<int64_t>(blockIdx.x) * 2 * D;
  for (int c = threadIdx.x; c < 2 * D; c += kThreads) {
    float sum = 0.f;
    for (int gi = 0; gi < gpb; ++gi) sum += wacc[gi * 2 * D + c];
    part[c] = sum;
  }
}

// ------------------------------------------------------------------------------------------------
// wtok: one warp per token (compile-time shape). A lane owns 2 vectors of 8 channels of a row: rotary lanes
// (r < P) the chunk at lo = 8r and its partner lo + n, pass-through lanes two vectors of the pass-through part
// (lo and lo + (D - rd)/2). L = lanes per row, RW = 32/L rows per warp step; the warp walks the token's q heads
// RW at a time, then its k heads. cos/sin of the lane's 8 angles in registers (once per token). dw partials
// in registers over all of the block's tokens (q and k), reduced at the end: xor butterfly over the warp's
// row slots, then warps summed in order in shared memory. PF = steps whose loads are in flight ahead of the
// math (0: load-then-compute). WREG: gains in registers (else read from shared memory each step).
// ------------------------------------------------------------------------------------------------
template <int D_, int RD_, int HQ_, int HK_, int KIND_>
struct Shape {
  static constexpr int D = D_, RD = RD_, HQ = HQ_, HK = HK_, KIND = KIND_;
};
using ShapeA = Shape<128, 128, 32, 8, kRms>;
using ShapeB = Shape<256, 64, 24, 4, kRmsOffset>;

template <class SH, int WPB, int MINB, int PF, bool WREG, bool CSM>
__global__ void __launch_bounds__(WPB * 32, MINB) wtok_kernel(const Args a) {
  constexpr int D = SH::D, RD = SH::RD, N = RD / 2, P = N / 8, L = P + (D - RD) / 16, RW = 32 / L;
  constexpr int HQ = SH::HQ, HK = SH::HK, SQ = HQ / RW, SK = HK / RW, S = SQ + SK;
  constexpr int KIND = SH::KIND;
  static_assert(N % 8 == 0 && (D - RD) % 16 == 0 && 32 % L == 0 && HQ % RW == 0 && HK % RW == 0, "layout");
  static_assert(SK >= 0 && S > 0, "heads");
  constexpr float d_inv = 1.f / static_cast<float>(D);
  __shared__ __align__(16) float gsm[2][D];
  __shared__ __align__(16) float red[WPB][2][D];
  __shared__ __align__(16) float2 cst[CSM ? WPB : 1][CSM ? N : 2];  // CSM: per-warp cos/sin of its token
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane % L, sub = lane / L;
  const bool rot = r < P;
  const int lo0 = rot ? r * 8 : RD + (r - P) * 8;
  const int lo1 = rot ? lo0 + N : lo0 + (D - RD) / 2;
  for (int c = threadIdx.x; c < 2 * D; c += WPB * 32) {
    const float w = c < D ? a.wq[c] : a.wk[c - D];
    gsm[c / D][c % D] = KIND == kRms ? w : 1.f + w;
  }
  __syncthreads();
  float gainr[2][16];
  if constexpr (WREG) {
#pragma unroll
    for (int ph = 0; ph < 2; ++ph)
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        gainr[ph][m] = gsm[ph][lo0 + m];
        gainr[ph][8 + m] = gsm[ph][lo1 + m];
      }
  }
  float acc[2][16];
#pragma unroll
  for (int ph = 0; ph < 2; ++ph)
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[ph][e] = 0.f;

  const int gw = blockIdx.x * WPB + warp, NW = gridDim.x * WPB;
  const int ntw = gw < a.T ? (a.T - gw + NW - 1) / NW : 0;
  const int K = ntw * S;
  uint4 buf[PF + 1][4];
  auto row_of = [&](int k, int& t, int& st) {
    const int i = k / S;
    st = k - i * S;
    t = gw + i * NW;
    return st < SQ ? (static_cast<int64_t>(t) * HQ + st * RW + sub) * D
                   : (static_cast<int64_t>(t) * HK + (st - SQ) * RW + sub) * D;
  };
  auto issue = [&](int k, uint4 (&b)[4]) {
    int t, st;
    const int64_t off = row_of(k, t, st);
    const uint16_t* xp = (st < SQ ? a.xq : a.xk) + off;
    const uint16_t* gp = (st < SQ ? a.gq : a.gk) + off;
    b[0] = ldg16(xp + lo0);
    b[1] = ldg16(xp + lo1);
    b[2] = ldg16(gp + lo0);
    b[3] = ldg16(gp + lo1);
  };
  float cc[8], sn[8];
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    cc[m] = 1.f;
    sn[m] = 0.f;
  }
  auto math = [&](const uint4 (&b)[4], uint16_t* yp, auto isq_c) {
    constexpr int ph = decltype(isq_c)::value ? 0 : 1;
    float x[16], g[16];
    unpack8(b[0], x);
    unpack8(b[1], x + 8);
    unpack8(b[2], g);
    unpack8(b[3], g + 8);
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < 16; ++e) ss += x[e] * x[e];
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float rstd = rstd_of(ss, d_inv, a.eps);
    if (P == L || rot) {  // pass-through lanes keep (1, 0): identity; the branch skips nothing for shape A
      if constexpr (CSM) {
        const float4* c4 = reinterpret_cast<const float4*>(&cst[warp][r * 8]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float4 w4 = c4[q];
          rot_back(g[2 * q], g[8 + 2 * q], w4.x, w4.y, &g[2 * q], &g[8 + 2 * q]);
          rot_back(g[2 * q + 1], g[9 + 2 * q], w4.z, w4.w, &g[2 * q + 1], &g[9 + 2 * q]);
        }
      } else {
#pragma unroll
        for (int m = 0; m < 8; ++m) rot_back(g[m], g[8 + m], cc[m], sn[m], &g[m], &g[8 + m]);
      }
    }
    float gn[16];
    if constexpr (WREG) {
#pragma unroll
      for (int e = 0; e < 16; ++e) gn[e] = gainr[ph][e];
    } else {
      const float4* g0 = reinterpret_cast<const float4*>(&gsm[ph][lo0]);
      const float4* g1 = reinterpret_cast<const float4*>(&gsm[ph][lo1]);
      const float4 t4[4] = {g0[0], g0[1], g1[0], g1[1]};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        gn[4 * q] = t4[q].x;
        gn[4 * q + 1] = t4[q].y;
        gn[4 * q + 2] = t4[q].z;
        gn[4 * q + 3] = t4[q].w;
      }
    }
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const float xhat = x[e] * rstd;
      const float xh = KIND == kRms ? bf_round(xhat) : xhat;
      acc[ph][e] += g[e] * xh;
      g[e] *= gn[e];  // dxhat
      dot += g[e] * xhat;
      x[e] = xhat;
    }
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float dd = dot * d_inv;
    float o[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) o[e] = rstd * (g[e] - x[e] * dd);
    st16(yp + lo0, pack8(o));
    st16(yp + lo1, pack8(o + 8));
  };

#pragma unroll
  for (int j = 0; j < PF; ++j)
    if (j < K) issue(j, buf[j]);
  for (int k0 = 0; k0 < K; k0 += PF + 1) {
#pragma unroll
    for (int j = 0; j <= PF; ++j) {
      const int k = k0 + j;
      if (k < K) {
        if (k + PF < K) issue(k + PF, buf[(j + PF) % (PF + 1)]);
        int t, st;
        const int64_t off = row_of(k, t, st);
        if (CSM && st == 0) {
          const float pf0 = static_cast<float>(__ldg(a.pos + t));
          const float pf1 = static_cast<float>(__ldg(a.pos + static_cast<int64_t>(a.T) + t));
          const float pf2 = static_cast<float>(__ldg(a.pos + 2 * static_cast<int64_t>(a.T) + t));
          __syncwarp();
          for (int jj = lane; jj < N; jj += 32) {
            float s_, c_;
            sincosf(pick3(slot_axis(jj, a.sec1, a.sec2), pf0, pf1, pf2) * __ldg(a.inv_freq + jj), &s_, &c_);
            cst[warp][jj] = make_float2(c_, s_);
          }
          __syncwarp();
        }
        if (!CSM && st == 0 && rot) {
          const float pf0 = static_cast<float>(__ldg(a.pos + t));
          const float pf1 = static_cast<float>(__ldg(a.pos + static_cast<int64_t>(a.T) + t));
          const float pf2 = static_cast<float>(__ldg(a.pos + 2 * static_cast<int64_t>(a.T) + t));
          const float4 f0 = __ldg(reinterpret_cast<const float4*>(a.inv_freq + r * 8));
          const float4 f1 = __ldg(reinterpret_cast<const float4*>(a.inv_freq + r * 8 + 4));
          const float fr[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
#pragma unroll
          for (int m = 0; m < 8; ++m)
            sincosf(pick3(slot_axis(r * 8 + m, a.sec1, a.sec2), pf0, pf1, pf2) * fr[m], &sn[m], &cc[m]);
        }
        if (st < SQ) math(buf[j], a.dxq + off, std::integral_constant<bool, true>());
        else math(buf[j], a.dxk + off, std::integral_constant<bool, false>());
      }
    }
  }
  // end: butterfly over the warp's row slots (deterministic), then warps in order
#pragma unroll
  for (int off = L; off < 32; off <<= 1)
#pragma unroll
    for (int ph = 0; ph < 2; ++ph)
#pragma unroll
      for (int e = 0; e < 16; ++e) acc[ph][e] += __shfl_xor_sync(0xffffffffu, acc[ph][e], off);
  if (sub == 0) {
#pragma unroll
    for (int ph = 0; ph < 2; ++ph)
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        red[warp][ph][lo0 + m] = acc[ph][m];
        red[warp][ph][lo1 + m] = acc[ph][8 + m];
      }
  }
  __syncthreads();
  float* part = a.part + static_cast<int64_t>(blockIdx.x) * 2 * D;
  for (int c = threadIdx.x; c < 2 * D; c += WPB * 32) {
    float s = 0.f;
#pragma unroll
    for (int wi = 0; wi < WPB; ++wi) s += red[wi][c / D][c % D];
    part[c] = s;
  }
}

// ------------------------------------------------------------------------------------------------
// checks and init
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
__global__ void init_bf16(uint16_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float u = (hash32(i * 0x9E3779B97F4A7C15ULL + seed) >> 8) * (1.f / 16777216.f);
    p[i] = f2bf(2.f * u - 1.f);
  }
}
__global__ void cmp_bf16(const uint16_t* a, const uint16_t* b, size_t n, unsigned* maxabs, unsigned long long* ndiff,
                         unsigned long long* nnan) {
  float mx = 0.f;
  unsigned long long nd = 0, nn = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float x = bf2f(a[i]), y = bf2f(b[i]);
    if (x != x) ++nn;
    else mx = fmaxf(mx, fabsf(x - y));
    nd += a[i] != b[i];
  }
  for (int off = 16; off > 0; off >>= 1) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    nd += __shfl_xor_sync(0xffffffffu, nd, off);
    nn += __shfl_xor_sync(0xffffffffu, nn, off);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMax(maxabs, __float_as_uint(mx));
    atomicAdd(ndiff, nd);
    atomicAdd(nnan, nn);
  }
}

// ------------------------------------------------------------------------------------------------
// host
// ------------------------------------------------------------------------------------------------
struct Sizes {
  const char* name;
  int hq, hk, D, rd, kind;
  int sec[3];  // mRoPE interleaved sections (sum rd/2)
};

constexpr int kSets = 3;
struct Bufs {
  uint16_t *x[kSets], *g[kSets], *y[kSets];
  uint16_t* yref;
  float* contrib;
  float *wq, *wk, *inv_freq, *part, *dw, *dwref, *refpart;
  long long* pos;  // [3][T] of the current T
  unsigned* stats;
};

struct Row {
  std::string shape, variant;
  int T;
  double us, ratio;
  float maxabs;
  unsigned long long ndiff, nnan;
  double dwq_rel, dwk_rel;
  bool det;
  int grid;
};

static int g_sms = 0;

static double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

template <class F>
static double time_it(F&& launch) {  // launch(set)
  const int warm = 5, iters = 30;
  for (int i = 0; i < warm; ++i) launch(i % kSets);
  CK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(ev[2 * i]));
    launch((i + warm) % kSets);
    CK(cudaEventRecord(ev[2 * i + 1]));
  }
  CK(cudaDeviceSynchronize());
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) CK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) CK(cudaEventDestroy(e));
  return median(ms) * 1000.0;
}

static Args make_args(const Bufs& b, const Sizes& s, int T, int set) {
  Args a;
  const size_t qe = static_cast<size_t>(T) * s.hq * s.D;
  a.xq = b.x[set];
  a.xk = b.x[set] + qe;
  a.gq = b.g[set];
  a.gk = b.g[set] + qe;
  a.dxq = b.y[set];
  a.dxk = b.y[set] + qe;
  a.wq = b.wq;
  a.wk = b.wk;
  a.inv_freq = b.inv_freq;
  a.pos = b.pos;
  a.sec1 = s.sec[1];
  a.sec2 = s.sec[2];
  a.part = b.part;
  a.T = T;
  a.hq = s.hq;
  a.hk = s.hk;
  a.D = s.D;
  a.rd = s.rd;
  a.eps = 1e-6f;
  return a;
}

// a variant: launch(args) runs the main kernel, returns its grid (number of partials)
struct Variant {
  std::string name;
  std::function<int(const Args&)> launch;
};

template <int KIND, int UPL, int R>
static int launch_base(const Args& a, int G, int grid_mode) {
  BP p;
  p.n = a.rd / 2;
  p.P = p.n / 8;
  p.U = p.P + (a.D - a.rd) / 8;
  p.G = G;
  p.hq = a.hq;
  p.H = a.hq + a.hk;
  const int gpb = kThreads / G;
  p.tok = std::max(1, std::min(32, (4 * R * gpb + p.H - 1) / p.H));
  p.tiles = (a.T + p.tok - 1) / p.tok;
  p.cs_bytes = (p.tok * p.n * 8 + 15) / 16 * 16;
  p.dq[0] = gpb / a.hq;
  p.dr[0] = gpb % a.hq;
  p.dq[1] = gpb / a.hk;
  p.dr[1] = gpb % a.hk;
  const size_t smem = p.cs_bytes + static_cast<size_t>(gpb) * 2 * a.D * sizeof(float);
  auto kern = base_kernel<KIND, UPL, R>;
  static bool attr = false;
  if (!attr) {
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    attr = true;
  }
  int grid = 1024;
  if (grid_mode > 0) {
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, kThreads, smem));
    grid = std::max(1, std::min(occ, grid_mode)) * g_sms;
  }
  grid = std::min(grid, p.tiles);
  kern<<<grid, kThreads, smem>>>(a, p);
  CKL();
  return grid;
}

template <class SH, int WPB, int MINB, int PF, bool WREG, bool CSM>
static int launch_wtok(const Args& a, int bps) {
  auto kern = wtok_kernel<SH, WPB, MINB, PF, WREG, CSM>;
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, WPB * 32, 0));
  int grid = std::max(1, std::min(occ, bps > 0 ? bps : occ)) * g_sms;
  grid = std::min(grid, (a.T + WPB - 1) / WPB);
  kern<<<grid, WPB * 32>>>(a);
  CKL();
  return grid;
}

int main() {
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  g_sms = prop.multiProcessorCount;
  printf("device: %s, %d SMs, L2 %.0f MB\n", prop.name, g_sms, prop.l2CacheSize / 1e6);

  const Sizes shapes[2] = {{"A", 32, 8, 128, 128, kRms, {24, 20, 20}}, {"B", 24, 4, 256, 64, kRmsOffset, {11, 11, 10}}};
  for (const auto& s : shapes)
    if (s.sec[0] + s.sec[1] + s.sec[2] != s.rd / 2) {
      fprintf(stderr, "sections of %s do not sum to rd/2\n", s.name);
      return 1;
    }
  const int Ts[2] = {32768, 131072};
  size_t maxE = 0, maxRowsD = 0;
  for (const auto& s : shapes) {
    maxE = std::max(maxE, static_cast<size_t>(Ts[1]) * (s.hq + s.hk) * s.D);
    maxRowsD = maxE;
  }
  Bufs b;
  for (int i = 0; i < kSets; ++i) {
    CK(cudaMalloc(&b.x[i], maxE * 2));
    CK(cudaMalloc(&b.g[i], maxE * 2));
    CK(cudaMalloc(&b.y[i], maxE * 2));
    init_bf16<<<4096, 256>>>(b.x[i], maxE, 1000 + i);
    CKL();
    init_bf16<<<4096, 256>>>(b.g[i], maxE, 2000 + i);
    CKL();
  }
  CK(cudaMalloc(&b.yref, maxE * 2));
  CK(cudaMalloc(&b.contrib, maxRowsD * sizeof(float)));
  const int kMaxBlocks = 8192, kRefCh = 512;
  CK(cudaMalloc(&b.wq, 256 * 4));
  CK(cudaMalloc(&b.wk, 256 * 4));
  CK(cudaMalloc(&b.inv_freq, 256 * 4));
  CK(cudaMalloc(&b.part, static_cast<size_t>(kMaxBlocks) * 2 * 256 * 4));
  CK(cudaMalloc(&b.refpart, static_cast<size_t>(kRefCh) * 2 * 256 * 4));
  CK(cudaMalloc(&b.dw, 2 * 256 * 4));
  CK(cudaMalloc(&b.dwref, 2 * 256 * 4));
  CK(cudaMalloc(&b.pos, 3 * static_cast<size_t>(Ts[1]) * sizeof(long long)));
  CK(cudaMalloc(&b.stats, 64));
  CK(cudaDeviceSynchronize());

  std::vector<Row> rows;
  for (int si = 0; si < 2; ++si) {
    const Sizes& s = shapes[si];
    const int D = s.D;
    {  // weights, inv_freq
      std::vector<float> wq(D), wk(D), inv(s.rd / 2);
      for (int c = 0; c < D; ++c) {
        const float u1 = std::sin(0.37f * c + 0.1f), u2 = std::cos(0.53f * c + 0.2f);
        wq[c] = s.kind == kRms ? 1.f + 0.2f * u1 : 0.2f * u1;
        wk[c] = s.kind == kRms ? 1.f + 0.2f * u2 : 0.2f * u2;
      }
      for (int j = 0; j < s.rd / 2; ++j) inv[j] = static_cast<float>(std::pow(1e6, -2.0 * j / s.rd));
      CK(cudaMemcpy(b.wq, wq.data(), D * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(b.wk, wk.data(), D * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(b.inv_freq, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
    }
    std::vector<Variant> vars;
    if (si == 0) {
      vars.push_back({"baseline", [](const Args& a) { return launch_base<kRms, 1, 1>(a, 8, 0); }});
      vars.push_back({"base_occ", [](const Args& a) { return launch_base<kRms, 1, 1>(a, 8, 4); }});
      vars.push_back({"base_r2", [](const Args& a) { return launch_base<kRms, 1, 2>(a, 8, 4); }});
      vars.push_back({"wtok_pf0", [](const Args& a) { return launch_wtok<ShapeA, 8, 2, 0, false, false>(a, 0); }});
      vars.push_back({"wtok_pf0_csm", [](const Args& a) { return launch_wtok<ShapeA, 8, 2, 0, false, true>(a, 0); }});
      vars.push_back({"wtok_pf1_csm", [](const Args& a) { return launch_wtok<ShapeA, 8, 2, 1, false, true>(a, 0); }});
      vars.push_back({"wtok_pf1_w4", [](const Args& a) { return launch_wtok<ShapeA, 4, 3, 1, false, false>(a, 0); }});
      vars.push_back({"wtok_pf1_wreg", [](const Args& a) { return launch_wtok<ShapeA, 4, 3, 1, true, false>(a, 0); }});
      vars.push_back({"wtok_pf2_w4", [](const Args& a) { return launch_wtok<ShapeA, 4, 3, 2, false, true>(a, 0); }});
      vars.push_back({"wtok_pf3_w4", [](const Args& a) { return launch_wtok<ShapeA, 4, 3, 3, false, true>(a, 0); }});
      vars.push_back({"wtok_pf3_w2", [](const Args& a) { return launch_wtok<ShapeA, 2, 6, 3, false, true>(a, 0); }});
    } else {
      vars.push_back({"baseline", [](const Args& a) { return launch_base<kRmsOffset, 2, 1>(a, 16, 0); }});
      vars.push_back({"base_occ", [](const Args& a) { return launch_base<kRmsOffset, 2, 1>(a, 16, 4); }});
      vars.push_back({"base_r2", [](const Args& a) { return launch_base<kRmsOffset, 2, 2>(a, 16, 4); }});
      vars.push_back({"wtok_pf0", [](const Args& a) { return launch_wtok<ShapeB, 8, 2, 0, false, false>(a, 0); }});
      vars.push_back({"wtok_pf0_csm", [](const Args& a) { return launch_wtok<ShapeB, 8, 2, 0, false, true>(a, 0); }});
      vars.push_back({"wtok_pf1_csm", [](const Args& a) { return launch_wtok<ShapeB, 8, 2, 1, false, true>(a, 0); }});
      vars.push_back({"wtok_pf1_w4", [](const Args& a) { return launch_wtok<ShapeB, 4, 3, 1, false, false>(a, 0); }});
      vars.push_back({"wtok_pf1_wreg", [](const Args& a) { return launch_wtok<ShapeB, 4, 3, 1, true, false>(a, 0); }});
      vars.push_back({"wtok_pf2_w4", [](const Args& a) { return launch_wtok<ShapeB, 4, 3, 2, false, true>(a, 0); }});
      vars.push_back({"wtok_pf3_w4", [](const Args& a) { return launch_wtok<ShapeB, 4, 3, 3, false, true>(a, 0); }});
      vars.push_back({"wtok_pf3_w2", [](const Args& a) { return launch_wtok<ShapeB, 2, 6, 3, false, true>(a, 0); }});
    }
    for (int T : Ts) {
      const size_t E = static_cast<size_t>(T) * (s.hq + s.hk) * D;
      const int64_t rq = static_cast<int64_t>(T) * s.hq, rk = static_cast<int64_t>(T) * s.hk;
      {  // positions [3][T] (row stride T): t, h, w
        std::vector<long long> pos(3 * static_cast<size_t>(T));
        for (int t = 0; t < T; ++t) {
          pos[t] = t % 4096;
          pos[static_cast<size_t>(T) + t] = (static_cast<long long>(t) * 7) % 1000;
          pos[2 * static_cast<size_t>(T) + t] = (static_cast<long long>(t) * 13) % 1000;
        }
        CK(cudaMemcpy(b.pos, pos.data(), pos.size() * sizeof(long long), cudaMemcpyHostToDevice));
      }
      // floor: D2D copy of q + k
      const double c_us = time_it([&](int set) {
        CK(cudaMemcpyAsync(b.y[set], b.x[set], E * 2, cudaMemcpyDeviceToDevice));
      });
      printf("shape %s T=%d: q+k %.0f MB, c = %.1f us (%.0f GB/s r+w)\n", s.name, T, E * 2 / 1e6, c_us,
             2.0 * E * 2 / (c_us * 1e3));
      // reference on set 0
      {
        Args a = make_args(b, s, T, 0);
        a.dxq = b.yref;
        a.dxk = b.yref + static_cast<size_t>(T) * s.hq * D;
        const int64_t nr = rq + rk;
        ref_rows<<<static_cast<unsigned>((nr + 127) / 128), 128>>>(a, s.kind, b.contrib);
        CKL();
        ref_dw_chunks<<<kRefCh, 256>>>(b.contrib, rq, rk, D, kRefCh, b.refpart);
        CKL();
        ref_dw_final<<<(2 * D + 255) / 256, 256>>>(b.refpart, kRefCh, D, b.dwref, b.dwref + D);
        CKL();
        CK(cudaDeviceSynchronize());
      }
      std::vector<float> dwref(2 * D);
      CK(cudaMemcpy(dwref.data(), b.dwref, 2 * D * 4, cudaMemcpyDeviceToHost));
      for (auto& v : vars) {
        auto run = [&](int set) {
          Args a = make_args(b, s, T, set);
          const int grid = v.launch(a);
          reduce_partials<<<(2 * D + 31) / 32, kThreads>>>(b.part, grid, D, b.dw, b.dw + D);
          CKL();
          return grid;
        };
        Row row;
        row.shape = s.name;
        row.variant = v.name;
        row.T = T;
        CK(cudaMemset(b.y[0], 0xFF, E * 2));
        row.grid = run(0);
        CK(cudaDeviceSynchronize());
        std::vector<float> dw1(2 * D), dw2(2 * D);
        CK(cudaMemcpy(dw1.data(), b.dw, 2 * D * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemset(b.stats, 0, 64));
        unsigned long long* st64 = reinterpret_cast<unsigned long long*>(b.stats + 2);
        cmp_bf16<<<2048, 256>>>(b.y[0], b.yref, E, b.stats, st64, st64 + 1);
        CKL();
        unsigned hs[6];
        CK(cudaMemcpy(hs, b.stats, 24, cudaMemcpyDeviceToHost));
        memcpy(&row.maxabs, &hs[0], 4);
        memcpy(&row.ndiff, &hs[2], 8);
        memcpy(&row.nnan, &hs[4], 8);
        run(0);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(dw2.data(), b.dw, 2 * D * 4, cudaMemcpyDeviceToHost));
        row.det = memcmp(dw1.data(), dw2.data(), 2 * D * 4) == 0;
        double rel[2] = {0, 0};
        for (int ph = 0; ph < 2; ++ph) {
          double mref = 0;
          for (int c = 0; c < D; ++c) mref = std::max(mref, (double)std::fabs(dwref[ph * D + c]));
          for (int c = 0; c < D; ++c) {
            const double d = std::fabs((double)dw1[ph * D + c] - dwref[ph * D + c]);
            rel[ph] = std::max(rel[ph], d / std::max((double)std::fabs(dwref[ph * D + c]), 1e-3 * mref));
          }
        }
        row.dwq_rel = rel[0];
        row.dwk_rel = rel[1];
        row.us = time_it([&](int set) { run(set); });
        row.ratio = row.us / c_us;
        printf("  %-14s %8.1f us %5.2fx%s\n", row.variant.c_str(), row.us, row.ratio,
               (row.nnan || !row.det) ? "  (NaN or nondeterministic!)" : "");
        fflush(stdout);
        rows.push_back(row);
      }
      rows.push_back(Row{s.name, "copy_c", T, c_us, 1.0, 0.f, 0, 0, 0, 0, true, 0});
    }
  }
  printf("\n==== summary (time us, ratio to D2D copy c of q+k; floor = 1.50x) ====\n");
  printf("%-2s %-7s %-14s %6s %9s %6s %9s %9s %5s %9s %9s %4s\n", "sh", "T", "variant", "grid", "us", "x c",
         "dx_maxab", "dx_ndiff", "nan", "dwq_rel", "dwk_rel", "det");
  for (const auto& r : rows) {
    if (r.variant == "copy_c") {
      printf("%-2s %-7d %-14s %6s %9.1f %6.2f\n", r.shape.c_str(), r.T, "copy c", "-", r.us, 1.0);
      continue;
    }
    printf("%-2s %-7d %-14s %6d %9.1f %6.2f %9.3g %9llu %5llu %9.2e %9.2e %4s\n", r.shape.c_str(), r.T,
           r.variant.c_str(), r.grid, r.us, r.ratio, r.maxabs, r.ndiff, r.nnan, r.dwq_rel, r.dwk_rel,
           r.det ? "yes" : "NO");
  }
  for (int i = 0; i < kSets; ++i) {
    CK(cudaFree(b.x[i]));
    CK(cudaFree(b.g[i]));
    CK(cudaFree(b.y[i]));
  }
  CK(cudaFree(b.yref));
  CK(cudaFree(b.contrib));
  CK(cudaFree(b.wq));
  CK(cudaFree(b.wk));
  CK(cudaFree(b.inv_freq));
  CK(cudaFree(b.part));
  CK(cudaFree(b.refpart));
  CK(cudaFree(b.dw));
  CK(cudaFree(b.dwref));
  CK(cudaFree(b.pos));
  CK(cudaFree(b.stats));
  return 0;
}
