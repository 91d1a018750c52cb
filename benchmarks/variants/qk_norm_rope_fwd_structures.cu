// qk_norm_rope_fwd_structures: forward-kernel variants of fused per-head QK-RMSNorm + neox rotary (bf16 in/out, fp32 math),
// with multimodal rotary (mRoPE, "interleaved" as transformers' Qwen3-VL apply_interleaved_mrope): positions
// int64 pos[3][T] (rows t, h, w); slot j uses row slot_axis(j) (h if j%3==1 && j<3*s1, w if j%3==2 && j<3*s2,
// else t).
// Self-contained. Build: nvcc -O3 -std=c++17 -arch=sm_90 -o qk_fwd qk_norm_rope_fwd_structures.cu
//
// Math (identical in every kernel, only the order of the sum of squares differs):
//   ss   = sum x^2 (fmaf chain per lane, then xor butterfly; the reference: one fmaf chain over the row)
//   rstd = 1 / sqrtf(ss * (1/D) + eps)            (IEEE sqrt and division, as the library)
//   rms:        xn = w * bf16(x * rstd)           rms_offset: xn = (x * rstd) * (1 + w)
//   angle = float(pos[slot_axis(j)][t]) * inv_freq[j]; sincosf; lo' = fmaf(lo, c, -(hi*s)), hi' = fmaf(hi, c, lo*s)
//   output rounded to bf16 once (RNE).
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#define CK(call)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, \
              #call);                                                                              \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)
#define CKL() CK(cudaGetLastError())

typedef uint16_t bf16_t;  // raw bf16 bits

template <int HQ_, int HK_, int D_, int RD_, int NORM_>
struct Shape {
  static constexpr int HQ = HQ_, HK = HK_, D = D_, RD = RD_, N = RD_ / 2, NORM = NORM_;
};
using ShapeA = Shape<32, 8, 128, 128, 0>;  // Qwen3-VL-8B, rms
using ShapeB = Shape<24, 4, 256, 64, 1>;   // Qwen3.5, rms_offset

constexpr float kEps = 1e-6f;

struct Args {
  const bf16_t* q;
  const bf16_t* k;
  bf16_t* oq;
  bf16_t* ok;
  const float* wq;
  const float* wk;
  const long long* pos;  // [3][T] (t, h, w rows, row stride T)
  const float* invf;
  int T;
  int sec1, sec2;  // mRoPE sections s1, s2 (s0 = N - s1 - s2 is implied)
};

__host__ __device__ constexpr int pow2ceil(int u) {
  int g = 1;
  while (g < u) g <<= 1;
  return g;
}

// ------------------------------------------------------------------------------------------------
// shared math
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ unsigned pack2(float a, float b) {
  const unsigned lo = __bfloat16_as_ushort(__float2bfloat16_rn(a));
  const unsigned hi = __bfloat16_as_ushort(__float2bfloat16_rn(b));
  return lo | (hi << 16);
}
__device__ __forceinline__ uint4 pack8(const float* f) {
  return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}
__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float bf16_to_f(bf16_t u) { return __uint_as_float(static_cast<unsigned>(u) << 16); }

template <int D>
__device__ __forceinline__ float rstd_of(float ss) {
  return 1.0f / sqrtf(__fadd_rn(__fmul_rn(ss, 1.0f / D), kEps));
}
// gain: w (rms) or 1 + w (rms_offset)
template <int NORM>
__device__ __forceinline__ float gain_of(float w) { return NORM == 0 ? w : __fadd_rn(1.0f, w); }
template <int NORM>
__device__ __forceinline__ float normv(float x, float rstd, float gain) {
  const float xh = __fmul_rn(x, rstd);
  return NORM == 0 ? __fmul_rn(gain, bf16_round(xh)) : __fmul_rn(xh, gain);
}
__device__ __forceinline__ void rot_pair(float lo, float hi, float c, float s, float* olo, float* ohi) {
  *olo = fmaf(lo, c, -__fmul_rn(hi, s));
  *ohi = fmaf(hi, c, __fmul_rn(lo, s));
}
__device__ __forceinline__ void cos_sin(long long pos, float invf, float* c, float* s) {
  sincosf(__fmul_rn(static_cast<float>(pos), invf), s, c);
}
// same angle from the position already converted to float (float(pos) is exact for |pos| < 2^24 either way)
__device__ __forceinline__ void cos_sin_f(float posf, float invf, float* c, float* s) {
  sincosf(__fmul_rn(posf, invf), s, c);
}
// mRoPE interleaved (transformers Qwen3-VL apply_interleaved_mrope): position row of frequency slot j
__device__ __forceinline__ int slot_axis(int j, int s1, int s2) {
  const int r = j % 3;
  return (r == 1 && j < 3 * s1) ? 1 : ((r == 2 && j < 3 * s2) ? 2 : 0);
}
template <typename V>
__device__ __forceinline__ V pick3(int ax, V v0, V v1, V v2) { return ax == 1 ? v1 : (ax == 2 ? v2 : v0); }
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    if (off < G) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
template <bool STREAM>
__device__ __forceinline__ uint4 ld16(const bf16_t* p) {
  if constexpr (STREAM) return __ldcs(reinterpret_cast<const uint4*>(p));
  else return *reinterpret_cast<const uint4*>(p);
}
template <bool STREAM>
__device__ __forceinline__ void st16(bf16_t* p, const uint4& v) {
  if constexpr (STREAM) __stcs(reinterpret_cast<uint4*>(p), v);
  else *reinterpret_cast<uint4*>(p) = v;
}
__device__ __forceinline__ void ld8f(const float* p, float* f) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// ------------------------------------------------------------------------------------------------
// reference: one thread per (token, head) row, simple loops
// ------------------------------------------------------------------------------------------------
template <class S>
__global__ void ref_kernel(const Args a) {
  constexpr int H = S::HQ + S::HK, D = S::D, N = S::N;
  const long long row = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= static_cast<long long>(a.T) * H) return;
  const int t = static_cast<int>(row / H), h = static_cast<int>(row % H);
  const bool isq = h < S::HQ;
  const bf16_t* x = isq ? a.q + (static_cast<size_t>(t) * S::HQ + h) * D
                        : a.k + (static_cast<size_t>(t) * S::HK + (h - S::HQ)) * D;
  bf16_t* y = isq ? a.oq + (static_cast<size_t>(t) * S::HQ + h) * D
                  : a.ok + (static_cast<size_t>(t) * S::HK + (h - S::HQ)) * D;
  const float* w = isq ? a.wq : a.wk;
  float ss = 0.f;
  for (int c = 0; c < D; ++c) {
    const float v = bf16_to_f(x[c]);
    ss = fmaf(v, v, ss);
  }
  const float rstd = rstd_of<D>(ss);
  auto xn = [&](int c) { return normv<S::NORM>(bf16_to_f(x[c]), rstd, gain_of<S::NORM>(w[c])); };
  const long long p0 = a.pos[t], p1 = a.pos[static_cast<size_t>(a.T) + t], p2 = a.pos[2 * static_cast<size_t>(a.T) + t];
  for (int c = 0; c < D; ++c) {
    float o;
    if (c < S::RD) {
      const int j = c < N ? c : c - N;
      float cs, sn;
      cos_sin(pick3(slot_axis(j, a.sec1, a.sec2), p0, p1, p2), a.invf[j], &cs, &sn);
      float olo, ohi;
      rot_pair(xn(j), xn(j + N), cs, sn, &olo, &ohi);
      o = c < N ? olo : ohi;
    } else {
      o = xn(c);
    }
    y[c] = __bfloat16_as_ushort(__float2bfloat16_rn(o));
  }
}

// ------------------------------------------------------------------------------------------------
// baseline (library structure) and its R-rows-per-iteration variants.
// 256 threads, G lanes per row, a lane holds one unit (rotary: chunk lo and its partner lo + n; pass-through:
// one chunk), butterfly sum, cos/sin of a tile of TOK tokens in shared memory (library's CosSin2 layout), q rows
// of the tile then k rows. R rows per group per iteration: all R rows' loads before any arithmetic.
// ------------------------------------------------------------------------------------------------
template <class S, int R, int TOK, int MINB>
__global__ void __launch_bounds__(256, MINB) base_kernel(const Args a) {
  constexpr int N = S::N, D = S::D, P = N / 8, U = P + (D - S::RD) / 8, G = pow2ceil(U), GPB = 256 / G;
  static_assert(U <= 32, "one unit per lane");
  __shared__ __align__(16) float2 cs[TOK * N];
  const int lane = threadIdx.x % G, grp = threadIdx.x / G;
  const bool uok = lane < U, rot = lane < P;
  const int lo = rot ? lane * 8 : S::RD + (lane - P) * 8;
  const int ntiles = (a.T + TOK - 1) / TOK;

  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int t0 = tile * TOK, ntok = min(TOK, a.T - t0);
    __syncthreads();
    for (int i = threadIdx.x; i < ntok * N; i += 256) {
      const int tl = i / N, e = i - tl * N, q2 = e >> 1, mp = q2 / P, uu = q2 - mp * P;
      const int j = uu * 8 + 2 * mp + (e & 1);
      float c, s;
      const int ax = slot_axis(j, a.sec1, a.sec2);
      cos_sin(__ldg(a.pos + static_cast<size_t>(ax) * a.T + t0 + tl), __ldg(a.invf + j), &c, &s);
      cs[i] = make_float2(c, s);
    }
    __syncthreads();

    auto phase = [&](auto hp_c, const bf16_t* __restrict__ in, bf16_t* __restrict__ out, const float* w) {
      constexpr int Hp = decltype(hp_c)::value;
      const int rows = ntok * Hp;
      for (int rb = 0; rb < rows; rb += R * GPB) {  // uniform trip count
        uint4 vl[R], vh[R];
        int tls[R];
        size_t offs[R];
        bool act[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const int row = rb + i * GPB + grp;
          act[i] = row < rows;
          const int tl = act[i] ? row / Hp : 0, hh = act[i] ? row - (row / Hp) * Hp : 0;
          tls[i] = tl;
          offs[i] = (static_cast<size_t>(t0 + tl) * Hp + hh) * D;
          vl[i] = make_uint4(0, 0, 0, 0);
          vh[i] = make_uint4(0, 0, 0, 0);
          if (act[i] && uok) {
            vl[i] = ld16<false>(in + offs[i] + lo);
            if (rot) vh[i] = ld16<false>(in + offs[i] + lo + N);
          }
        }
        float rstd[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
          float x0[8], x1[8];
          unpack8(vl[i], x0);
          unpack8(vh[i], x1);
          float ss = 0.f;
#pragma unroll
          for (int m = 0; m < 8; ++m) ss = fmaf(x0[m], x0[m], ss);
#pragma unroll
          for (int m = 0; m < 8; ++m) ss = fmaf(x1[m], x1[m], ss);
          rstd[i] = ss;
        }
#pragma unroll
        for (int i = 0; i < R; ++i) rstd[i] = rstd_of<D>(group_sum<G>(rstd[i]));
#pragma unroll
        for (int i = 0; i < R; ++i) {
          if (!(act[i] && uok)) continue;
          float w0[8], w1[8], x0[8], x1[8];
          ld8f(w + lo, w0);
          if (rot) ld8f(w + lo + N, w1);
          else
#pragma unroll
            for (int m = 0; m < 8; ++m) w1[m] = 0.f;
          unpack8(vl[i], x0);
          unpack8(vh[i], x1);
#pragma unroll
          for (int m = 0; m < 8; ++m) {
            x0[m] = normv<S::NORM>(x0[m], rstd[i], gain_of<S::NORM>(w0[m]));
            x1[m] = normv<S::NORM>(x1[m], rstd[i], gain_of<S::NORM>(w1[m]));
          }
          if (rot) {
            const float4* c4 = reinterpret_cast<const float4*>(cs + tls[i] * N);
#pragma unroll
            for (int mp = 0; mp < 4; ++mp) {
              const float4 cw = c4[mp * P + lane];
              rot_pair(x0[2 * mp], x1[2 * mp], cw.x, cw.y, &x0[2 * mp], &x1[2 * mp]);
              rot_pair(x0[2 * mp + 1], x1[2 * mp + 1], cw.z, cw.w, &x0[2 * mp + 1], &x1[2 * mp + 1]);
            }
          }
          st16<false>(out + offs[i] + lo, pack8(x0));
          if (rot) st16<false>(out + offs[i] + lo + N, pack8(x1));
        }
      }
    };
    phase(std::integral_constant<int, S::HQ>{}, a.q, a.oq, a.wq);
    phase(std::integral_constant<int, S::HK>{}, a.k, a.ok, a.wk);
  }
}

// ------------------------------------------------------------------------------------------------
// warp per token ("wt"), persistent: warp w owns the contiguous token range [T*w/NW, T*(w+1)/NW) and walks
// all q then k rows of each token in steps (one step = 32 lanes x 16 B per chunk set). A K-deep ring of
// register buffers: the load of step s+K (possibly of the next token) is issued before the math of step s.
// cos/sin per lane in registers (the 8 angles of its own chunk), computed once per token: no shared memory,
// no barriers. Gains of q and k for the lane's channels live in registers.
//  LAYOUT 0 "split": one chunk per lane, D/8 lanes per row (A: 2 rows / step, B: 1 row / step); the rotary
//                    partner chunk lives in lane ^ (n/8): 8 float shuffles of the normalized values.
//  LAYOUT 1 "pair":  the baseline's unit layout (lane holds lo chunk and its partner lo + n), G lanes per row
//                    (A: 8 -> 4 rows / step, B: 32 with 28 active -> 1 row / step). No partner shuffles.
// ------------------------------------------------------------------------------------------------
template <class S, int LAYOUT, int K, int MINB, bool STREAM, bool WREG = true>
__global__ void __launch_bounds__(256, MINB) wt_kernel(const Args a) {
  constexpr bool SPLIT = LAYOUT == 0;
  constexpr int N = S::N, D = S::D, RD = S::RD, P = N / 8;
  constexpr int U = SPLIT ? D / 8 : P + (D - RD) / 8;
  constexpr int G = SPLIT ? D / 8 : pow2ceil(U);
  static_assert(G <= 32, "row within a warp");
  constexpr int RPS = 32 / G;  // rows per step
  constexpr int NCH = SPLIT ? 1 : 2;
  static_assert(S::HQ % RPS == 0 && S::HK % RPS == 0, "heads per step");
  constexpr int SQ = S::HQ / RPS, SK = S::HK / RPS, ST = SQ + SK;
  static_assert(ST % K == 0 && K <= ST, "K divides the steps of a token");
  constexpr int SE = RPS * D;  // elements per step

  const int lane = threadIdx.x & 31, u = lane % G, r = lane / G;
  const bool act = u < U;
  const bool rot = SPLIT ? (u * 8 < RD) : (u < P);
  const int lo = SPLIT ? u * 8 : (rot ? u * 8 : RD + (u - P) * 8);
  const bool two = !SPLIT && rot && act;  // second chunk at lo + N
  const int loff = r * D + lo;

  float gq[NCH][8], gk[NCH][8];
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const bool has = WREG && act && (c == 0 || two);
    if (has) {
      ld8f(a.wq + lo + c * N, gq[c]);
      ld8f(a.wk + lo + c * N, gk[c]);
    }
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      gq[c][m] = has ? gain_of<S::NORM>(gq[c][m]) : 0.f;
      gk[c][m] = has ? gain_of<S::NORM>(gk[c][m]) : 0.f;
    }
  }
  const int j0 = SPLIT ? (lo & (N - 1)) : lo;
  // split: out = fmaf(own, c, partner * s'), s' = -s on the first half (lo lanes), +s on the second
  const float sgn = (SPLIT && (lo & N) == 0) ? -1.f : 1.f;

  const int w = static_cast<int>((static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5);
  const int NW = static_cast<int>((static_cast<long long>(gridDim.x) * blockDim.x) >> 5);
  const int tb = static_cast<int>(static_cast<long long>(a.T) * w / NW);
  const int te = static_cast<int>(static_cast<long long>(a.T) * (w + 1) / NW);
  if (tb >= te) return;  // warp-uniform

  auto eoff = [&](int t, int s) -> size_t {
    return s < SQ ? (static_cast<size_t>(t) * SQ + s) * SE + loff
                  : (static_cast<size_t>(t) * SK + (s - SQ)) * SE + loff;
  };
  auto load = [&](int t, int s, uint4* v) {
    const bf16_t* base = (s < SQ ? a.q : a.k) + eoff(t, s);
    if (act) v[0] = ld16<STREAM>(base);
    if (two) v[1] = ld16<STREAM>(base + N);
  };

  uint4 buf[K][NCH];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int c = 0; c < NCH; ++c) buf[k][c] = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int k = 0; k < K; ++k) load(tb, k, buf[k]);

  for (int t = tb; t < te; ++t) {
    float cs[8], sn[8];
    if (rot && act) {
      const float p0 = static_cast<float>(__ldg(a.pos + t));
      const float p1 = static_cast<float>(__ldg(a.pos + static_cast<size_t>(a.T) + t));
      const float p2 = static_cast<float>(__ldg(a.pos + 2 * static_cast<size_t>(a.T) + t));
      float f[8];
      ld8f(a.invf + j0, f);
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const float pm = pick3(slot_axis(j0 + m, a.sec1, a.sec2), p0, p1, p2);
        cos_sin_f(pm, f[m], &cs[m], &sn[m]);
        sn[m] *= sgn;
      }
    } else {
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        cs[m] = 1.f;
        sn[m] = 0.f;
      }
    }
#pragma unroll 1
    for (int sb = 0; sb < ST; sb += K) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int s = sb + k;
        uint4 v[NCH];
#pragma unroll
        for (int c = 0; c < NCH; ++c) v[c] = buf[k][c];
        {  // prefetch step s + K (next token when past the end of this one)
          int ns = s + K, nt = t;
          if (ns >= ST) {
            ns -= ST;
            ++nt;
          }
          if (nt < te) load(nt, ns, buf[k]);
        }
        const bool isq = s < SQ;
        float x[NCH][8];
        float ss = 0.f;
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
          unpack8(v[c], x[c]);
          if (c == 1 && !two) {
#pragma unroll
            for (int m = 0; m < 8; ++m) x[c][m] = 0.f;
          }
#pragma unroll
          for (int m = 0; m < 8; ++m) ss = fmaf(x[c][m], x[c][m], ss);
        }
        if (!act) ss = 0.f;
        const float rstd = rstd_of<D>(group_sum<G>(ss));
        if constexpr (WREG) {
#pragma unroll
          for (int c = 0; c < NCH; ++c)
#pragma unroll
            for (int m = 0; m < 8; ++m) x[c][m] = normv<S::NORM>(x[c][m], rstd, isq ? gq[c][m] : gk[c][m]);
        } else {  // the weights re-read each step (L1 hits): fewer registers
#pragma unroll
          for (int c = 0; c < NCH; ++c) {
            float g[8];
#pragma unroll
            for (int m = 0; m < 8; ++m) g[m] = 0.f;
            if (act && (c == 0 || two)) ld8f((isq ? a.wq : a.wk) + lo + c * N, g);
#pragma unroll
            for (int m = 0; m < 8; ++m) x[c][m] = normv<S::NORM>(x[c][m], rstd, gain_of<S::NORM>(g[m]));
          }
        }
        if constexpr (SPLIT) {
#pragma unroll
          for (int m = 0; m < 8; ++m) {
            const float pv = __shfl_xor_sync(0xffffffffu, x[0][m], N / 8);
            const float o = fmaf(x[0][m], cs[m], __fmul_rn(pv, sn[m]));
            x[0][m] = rot ? o : x[0][m];
          }
        } else {
          if (two) {
#pragma unroll
            for (int m = 0; m < 8; ++m) rot_pair(x[0][m], x[NCH - 1][m], cs[m], sn[m], &x[0][m], &x[NCH - 1][m]);
          }
        }
        bf16_t* ob = (isq ? a.oq : a.ok) + eoff(t, s);
        if (act) st16<STREAM>(ob, pack8(x[0]));
        if (two) st16<STREAM>(ob + N, pack8(x[NCH - 1]));
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// copy floor kernel: 16-byte vectors, 4 per thread per iteration (loads first), q then k
// ------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(256) copy_kernel(const uint4* __restrict__ q, uint4* __restrict__ oq, size_t nq,
                                                   const uint4* __restrict__ k, uint4* __restrict__ ok, size_t nk) {
  const size_t n = nq + nk;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const size_t e = i + j * stride;
      if (e < n) v[j] = e < nq ? q[e] : k[e - nq];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const size_t e = i + j * stride;
      if (e < n) {
        if (e < nq) oq[e] = v[j];
        else ok[e - nq] = v[j];
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// data init and comparison
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned hash32(unsigned x) {
  x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
  return x;
}
__global__ void fill_kernel(bf16_t* p, size_t n, unsigned seed) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const unsigned h = hash32(static_cast<unsigned>(i) ^ hash32(seed + static_cast<unsigned>(i >> 32) * 0x9e3779b9u));
    const float v = (static_cast<float>(h >> 8) * (1.0f / 16777216.0f)) * 4.0f - 2.0f;  // [-2, 2)
    p[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}
__global__ void pos_kernel(long long* p, int T) {  // [3][T]: t, h, w rows
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < T) {
    p[i] = i % 4096;
    p[static_cast<size_t>(T) + i] = (static_cast<long long>(i) * 7) % 1000;
    p[2 * static_cast<size_t>(T) + i] = (static_cast<long long>(i) * 13) % 1000;
  }
}
struct Stats {
  unsigned long long ndiff, nnan;
  unsigned maxulp, maxabs;
};
__device__ __forceinline__ int bf_ord(unsigned u) { return (u & 0x8000u) ? -static_cast<int>(u & 0x7fffu) : static_cast<int>(u); }
__global__ void cmp_kernel(const bf16_t* out, const bf16_t* ref, size_t n, Stats* st) {
  unsigned long long nd = 0, nn = 0;
  unsigned mu = 0;
  float ma = 0.f;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const unsigned o = out[i], r = ref[i];
    if ((o & 0x7fffu) > 0x7f80u) {
      ++nn;
      continue;
    }
    if (o != r) {
      const int d = abs(bf_ord(o) - bf_ord(r));
      if (d != 0) {
        ++nd;
        mu = max(mu, static_cast<unsigned>(d));
        ma = fmaxf(ma, fabsf(bf16_to_f(static_cast<bf16_t>(o)) - bf16_to_f(static_cast<bf16_t>(r))));
      }
    }
  }
  if (nd) atomicAdd(&st->ndiff, nd);
  if (nn) atomicAdd(&st->nnan, nn);
  if (mu) atomicMax(&st->maxulp, mu);
  if (ma > 0.f) atomicMax(&st->maxabs, __float_as_uint(ma));
}

// ------------------------------------------------------------------------------------------------
// host
// ------------------------------------------------------------------------------------------------
struct Row {
  std::string shape, name;
  int T;
  float us, ratio_memcpy, ratio_copyk;
  bool checked;
  Stats st;
  int regs, blocks_per_sm;
  double bytes;  // q + k read and written
};
static std::vector<Row> g_rows;
static int g_sms = 0;

template <typename Kern>
static void kinfo(Kern k, int threads, int* regs, int* bps) {
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, k));
  *regs = fa.numRegs;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(bps, k, threads, 0));
}

template <class S>
static void run_shape(const char* sname, int T, int nsets) {
  constexpr int H = S::HQ + S::HK;
  const size_t nq = static_cast<size_t>(T) * S::HQ * S::D, nk = static_cast<size_t>(T) * S::HK * S::D;
  const size_t bq = nq * sizeof(bf16_t), bk = nk * sizeof(bf16_t);
  printf("\n== shape %s T=%d  Hq=%d Hk=%d D=%d rd=%d norm=%s mrope-interleaved  q+k = %.1f MB, %d input sets\n", sname, T, S::HQ, S::HK,
         S::D, S::RD, S::NORM == 0 ? "rms" : "rms_offset", (bq + bk) / 1e6, nsets);
  std::vector<bf16_t*> iq(nsets), ik(nsets);
  for (int s = 0; s < nsets; ++s) {
    CK(cudaMalloc(&iq[s], bq));
    CK(cudaMalloc(&ik[s], bk));
    fill_kernel<<<4096, 256>>>(iq[s], nq, 1000u + 17u * s);
    CKL();
    fill_kernel<<<4096, 256>>>(ik[s], nk, 5000u + 31u * s);
    CKL();
  }
  bf16_t *oq, *ok, *rq, *rk;
  CK(cudaMalloc(&oq, bq));
  CK(cudaMalloc(&ok, bk));
  CK(cudaMalloc(&rq, bq));
  CK(cudaMalloc(&rk, bk));
  float *wq, *wk, *invf;
  long long* pos;
  CK(cudaMalloc(&wq, S::D * sizeof(float)));
  CK(cudaMalloc(&wk, S::D * sizeof(float)));
  CK(cudaMalloc(&invf, S::N * sizeof(float)));
  CK(cudaMalloc(&pos, 3 * static_cast<size_t>(T) * sizeof(long long)));
  // mRoPE interleaved sections: A (n = 64) {24, 20, 20} (Qwen3-VL), B (n = 32) {11, 11, 10} (Qwen3.5)
  constexpr int kSec0 = S::N == 64 ? 24 : 11, kSec1 = S::N == 64 ? 20 : 11, kSec2 = S::N == 64 ? 20 : 10;
  static_assert(kSec0 + kSec1 + kSec2 == S::N, "sections sum to n");
  {
    std::vector<float> h(S::D), g(S::D), f(S::N);
    for (int c = 0; c < S::D; ++c) {
      const float a = static_cast<float>((c * 37 + 11) % 101) / 100.f, b = static_cast<float>((c * 53 + 7) % 97) / 96.f;
      h[c] = S::NORM == 0 ? 0.5f + a : a - 0.5f;  // rms: around 1; offset: around 0
      g[c] = S::NORM == 0 ? 0.5f + b : b - 0.5f;
    }
    for (int j = 0; j < S::N; ++j) f[j] = static_cast<float>(std::pow(1e6, -2.0 * j / S::RD));
    CK(cudaMemcpy(wq, h.data(), S::D * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(wk, g.data(), S::D * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(invf, f.data(), S::N * sizeof(float), cudaMemcpyHostToDevice));
  }
  pos_kernel<<<(T + 255) / 256, 256>>>(pos, T);
  CKL();
  Stats* dst;
  CK(cudaMalloc(&dst, sizeof(Stats)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto args = [&](int set, bf16_t* outq, bf16_t* outk) {
    Args a;
    a.q = iq[set]; a.k = ik[set]; a.oq = outq; a.ok = outk;
    a.wq = wq; a.wk = wk; a.pos = pos; a.invf = invf; a.T = T; a.sec1 = kSec1; a.sec2 = kSec2;
    return a;
  };
  CK(cudaDeviceSynchronize());

  // reference (set 0), timed once
  {
    const long long rows = static_cast<long long>(T) * H;
    CK(cudaEventRecord(e0));
    ref_kernel<S><<<static_cast<unsigned>((rows + 127) / 128), 128>>>(args(0, rq, rk));
    CKL();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    Row r{};
    r.shape = sname; r.name = "reference(1thr/row)"; r.T = T; r.us = ms * 1e3f; r.checked = false;
    r.bytes = 2.0 * (bq + bk);
    g_rows.push_back(r);
  }

  float memcpy_us = 0.f, copyk_us = 0.f;
  auto bench = [&](const std::string& name, std::function<void(int)> launch, bool check, int regs, int bps) {
    if (check) {
      CK(cudaMemset(oq, 0xFF, bq));
      CK(cudaMemset(ok, 0xFF, bk));
    }
    launch(0);
    CKL();
    CK(cudaDeviceSynchronize());
    Stats st{};
    if (check) {
      CK(cudaMemset(dst, 0, sizeof(Stats)));
      cmp_kernel<<<1024, 256>>>(oq, rq, nq, dst);
      CKL();
      cmp_kernel<<<1024, 256>>>(ok, rk, nk, dst);
      CKL();
      CK(cudaMemcpy(&st, dst, sizeof(Stats), cudaMemcpyDeviceToHost));
    }
    for (int i = 0; i < 5; ++i) launch((i + 1) % nsets);
    CKL();
    std::vector<float> t;
    for (int i = 0; i < 30; ++i) {
      CK(cudaEventRecord(e0));
      launch(i % nsets);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      CKL();
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    const float us = 0.5f * (t[14] + t[15]) * 1e3f;
    if (name == "memcpy_d2d") memcpy_us = us;
    if (name == "copy_kernel16B") copyk_us = us;
    Row r{};
    r.shape = sname; r.name = name; r.T = T; r.us = us;
    r.ratio_memcpy = memcpy_us > 0 ? us / memcpy_us : 0.f;
    r.ratio_copyk = copyk_us > 0 ? us / copyk_us : 0.f;
    r.checked = check; r.st = st; r.regs = regs; r.blocks_per_sm = bps; r.bytes = 2.0 * (bq + bk);
    g_rows.push_back(r);
    float ma;
    memcpy(&ma, &st.maxabs, 4);
    printf("  %-26s %9.1f us  x%.3f memcpy  (min %.1f max %.1f)  regs %d  blk/SM %d", name.c_str(), us, r.ratio_memcpy,
           t[0] * 1e3f, t[29] * 1e3f, regs, bps);
    if (check)
      printf("  maxabs %.3g maxulp %u ndiff %llu nan %llu", ma, st.maxulp, static_cast<unsigned long long>(st.ndiff),
             static_cast<unsigned long long>(st.nnan));
    printf("\n");
    fflush(stdout);
  };

  // 1. copy floor
  bench("memcpy_d2d", [&](int s) {
    CK(cudaMemcpyAsync(oq, iq[s], bq, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpyAsync(ok, ik[s], bk, cudaMemcpyDeviceToDevice));
  }, false, 0, 0);
  {
    int regs, bps;
    kinfo(copy_kernel, 256, &regs, &bps);
    const unsigned grid = static_cast<unsigned>(g_sms * bps);
    bench("copy_kernel16B", [&](int s) {
      copy_kernel<<<grid, 256>>>(reinterpret_cast<const uint4*>(iq[s]), reinterpret_cast<uint4*>(oq), bq / 16,
                                 reinterpret_cast<const uint4*>(ik[s]), reinterpret_cast<uint4*>(ok), bk / 16);
    }, false, regs, bps);
  }

  // 2. baseline and R-rows variants (grid = tiles, as the library)
  auto base = [&](const std::string& name, auto kern, int tok) {
    int regs, bps;
    kinfo(kern, 256, &regs, &bps);
    const unsigned grid = static_cast<unsigned>((T + tok - 1) / tok);
    bench(name, [&, kern, grid](int s) { kern<<<grid, 256>>>(args(s, oq, ok)); }, true, regs, bps);
  };
  constexpr bool kA = S::D == 128;
  base("baseline_R1_tok8", base_kernel<S, 1, 8, 3>, 8);
  base("base_R1_tok8_minb4", base_kernel<S, 1, 8, 4>, 8);
  base(kA ? "base_R2_tok16" : "base_R2_tok8", base_kernel<S, 2, kA ? 16 : 8, 3>, kA ? 16 : 8);
  base(kA ? "base_R4_tok32" : "base_R4_tok8", base_kernel<S, 4, kA ? 32 : 8, 2>, kA ? 32 : 8);

  // 3. warp per token, persistent grid (occupancy-filled)
  auto wt = [&](const std::string& name, auto kern) {
    int regs, bps;
    kinfo(kern, 256, &regs, &bps);
    const unsigned grid = static_cast<unsigned>(g_sms * bps);
    bench(name, [&, kern, grid](int s) { kern<<<grid, 256>>>(args(s, oq, ok)); }, true, regs, bps);
  };
  // steps per token: split A 20, B 28; pair A 10, B 28 (K divides them). MINB picked so that nothing spills.
  if constexpr (kA) {
    wt("wt_split_K4_minb3", wt_kernel<S, 0, 4, 3, false>);
    wt("wt_split_K5_minb3", wt_kernel<S, 0, 5, 3, false>);
    wt("wt_split_K10_minb2", wt_kernel<S, 0, 10, 2, false>);
    wt("wt_split_K20_minb1", wt_kernel<S, 0, 20, 1, false>);
    wt("wt_split_K5_minb3_cs", wt_kernel<S, 0, 5, 3, true>);
    wt("wt_split_K4_minb4_wL1", wt_kernel<S, 0, 4, 4, false, false>);
    wt("wt_split_K5_minb3_wL1", wt_kernel<S, 0, 5, 3, false, false>);
    wt("wt_pair_K2_minb2", wt_kernel<S, 1, 2, 2, false>);
    wt("wt_pair_K5_minb2", wt_kernel<S, 1, 5, 2, false>);
  } else {
    wt("wt_split_K4_minb3", wt_kernel<S, 0, 4, 3, false>);
    wt("wt_split_K7_minb2", wt_kernel<S, 0, 7, 2, false>);
    wt("wt_split_K14_minb2", wt_kernel<S, 0, 14, 2, false>);
    wt("wt_split_K28_minb1", wt_kernel<S, 0, 28, 1, false>);
    wt("wt_split_K7_minb2_cs", wt_kernel<S, 0, 7, 2, true>);
    wt("wt_split_K7_minb3_wL1", wt_kernel<S, 0, 7, 3, false, false>);
    wt("wt_pair_K2_minb2", wt_kernel<S, 1, 2, 2, false>);
    wt("wt_pair_K4_minb2", wt_kernel<S, 1, 4, 2, false>);
  }

  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  for (int s = 0; s < nsets; ++s) {
    CK(cudaFree(iq[s]));
    CK(cudaFree(ik[s]));
  }
  CK(cudaFree(oq)); CK(cudaFree(ok)); CK(cudaFree(rq)); CK(cudaFree(rk));
  CK(cudaFree(wq)); CK(cudaFree(wk)); CK(cudaFree(invf)); CK(cudaFree(pos)); CK(cudaFree(dst));
}

int main() {
  int dev = 0;
  CK(cudaSetDevice(dev));
  cudaDeviceProp pr;
  CK(cudaGetDeviceProperties(&pr, dev));
  g_sms = pr.multiProcessorCount;
  printf("device %s  SMs %d  L2 %.0f MB\n", pr.name, g_sms, pr.l2CacheSize / 1e6);
  run_shape<ShapeA>("A", 32768, 3);
  run_shape<ShapeB>("B", 32768, 3);
  run_shape<ShapeA>("A", 131072, 2);
  run_shape<ShapeB>("B", 131072, 2);

  printf("\n==== summary (median of 30 after 5 warm-ups; x = time / memcpy_d2d of q+k; err vs reference) ====\n");
  printf("%-2s %-6s %-26s %9s %5s %7s %7s %4s %3s %9s %4s %9s %4s\n", "sh", "T", "variant", "us", "TB/s", "x_mcpy", "x_copyk",
         "regs", "bps", "maxabs", "ulp", "ndiff", "nan");
  int bad = 0;
  for (Row& r : g_rows)
    for (const Row& m : g_rows)
      if (m.shape == r.shape && m.T == r.T) {
        if (m.name == "memcpy_d2d") r.ratio_memcpy = r.us / m.us;
        if (m.name == "copy_kernel16B") r.ratio_copyk = r.us / m.us;
      }
  for (const Row& r : g_rows) {
    float ma;
    memcpy(&ma, &r.st.maxabs, 4);
    if (r.checked) {
      printf("%-2s %-6d %-26s %9.1f %5.2f %7.3f %7.3f %4d %3d %9.3g %4u %9llu %4llu%s\n", r.shape.c_str(), r.T, r.name.c_str(),
             r.us, r.bytes / (r.us * 1e6), r.ratio_memcpy, r.ratio_copyk, r.regs, r.blocks_per_sm, ma, r.st.maxulp,
             static_cast<unsigned long long>(r.st.ndiff), static_cast<unsigned long long>(r.st.nnan),
             (r.st.nnan || r.st.maxulp > 1) ? "  <-- BAD" : "");
      if (r.st.nnan || r.st.maxulp > 1) ++bad;
    } else {
      printf("%-2s %-6d %-26s %9.1f %5.2f %7.3f %7.3f %4d %3d %9s %4s %9s %4s\n", r.shape.c_str(), r.T, r.name.c_str(), r.us,
             r.bytes / (r.us * 1e6), r.ratio_memcpy, r.ratio_copyk, r.regs, r.blocks_per_sm, "-", "-", "-", "-");
    }
  }
  printf("%s\n", bad ? "SOME VARIANTS FAILED CORRECTNESS" : "all checked variants: no NaN, <= 1 bf16 ulp vs reference");
  return bad ? 2 : 0;
}
