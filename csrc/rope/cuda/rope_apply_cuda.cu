// Fused rotary application on the GPU. Token-linear grid: a block takes a tile of tokens, computes cos/sin
// of every (token, slot) once into shared memory, then rotates all Hq + Hk heads of q and k with vector
// loads/stores along head_dim (16 bytes where alignment allows). No allocation, no sync.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_utils.cuh"
#include "rope/rope_apply.h"
#include "rope/rope_math.h"

namespace packcuda::rope {
namespace {

constexpr int kThreads = 256;
constexpr int kItemsPerBlock = 4096;   // target (token, head, chunk) items per block
constexpr int kMaxTokensPerBlock = 32;
constexpr int kSmemBudget = 32 * 1024;

template <typename T> struct Cvt;
template <> struct Cvt<double> {
  using F = double;
  static __device__ __forceinline__ double load(double v) { return v; }
  static __device__ __forceinline__ double store(double f) { return f; }
};
template <> struct Cvt<float> {
  using F = float;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float f) { return f; }
};
template <> struct Cvt<__nv_bfloat16> {
  using F = float;
  static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 store(float f) { return __float2bfloat16_rn(f); }
};
template <> struct Cvt<__half> {
  using F = float;
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half store(float f) { return __float2half_rn(f); }
};

template <typename T, int VE, int ALIGN>
struct alignas(ALIGN) Vec {
  T v[VE];
};

struct TokenBase {
  int64_t q_in, q_out, k_in, k_out, pos;
};

struct KParams {
  RopeArgs a;
  int64_t n;            // rotary_dim / 2
  int tok_per_block;
  int chunks_rot;       // vector chunks per head that hold rotary pairs (neox: n / VE, gptj: rd / VE)
  int chunks_pass;      // chunks per head of passthrough channels (0 when not copied)
  bool pass_vec;        // passthrough chunks are vectors of VE elements (else single elements)
};

// One item = (local token, head over q then k, chunk). Loads for U items are issued before any store.
template <typename T, int VE, int ALIGN, bool GPTJ>
__global__ void __launch_bounds__(kThreads, 4) rope_kernel(const KParams p) {
  using V = Vec<T, VE, ALIGN>;
  using F = typename Cvt<T>::F;  // compute type
  const RopeArgs& a = p.a;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  F* cs = reinterpret_cast<F*>(smem_raw);  // [tok_per_block][n][2] = (cos, sin)
  __shared__ TokenBase base[kMaxTokensPerBlock];

  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * p.tok_per_block;
  const int ntok = static_cast<int>(min(static_cast<int64_t>(p.tok_per_block), a.tokens - t0));
  const int n = static_cast<int>(p.n);

  // 1. the tile's token base offsets, then cos/sin of every (token, slot) of the tile.
  for (int tl = threadIdx.x; tl < ntok; tl += kThreads) {
    const int64_t t = t0 + tl;
    base[tl] = TokenBase{token_offset(t, a.seq, a.q.in_sb, a.q.in_ss), token_offset(t, a.seq, a.q.out_sb, a.q.out_ss),
                         token_offset(t, a.seq, a.k.in_sb, a.k.in_ss), token_offset(t, a.seq, a.k.out_sb, a.k.out_ss),
                         token_offset(t, a.seq, a.pos_sb, a.pos_ss)};
  }
  __syncthreads();
  for (int i = threadIdx.x; i < ntok * n; i += kThreads) {
    const int tl = i / n, j = i - tl * n;
    const int r = slot_axis(j, a.layout, a.section[0], a.section[1], a.section[2]);
    const int64_t off = r * a.pos_row_stride + base[tl].pos;
    const int64_t pos = a.pos_int64 ? __ldg(static_cast<const long long*>(a.pos) + off)
                                    : __ldg(static_cast<const int*>(a.pos) + off);
    F c, s;
    rope_cos_sin(rope_angle(pos, __ldg(a.inv_freq + j)), static_cast<F>(a.scaling), a.inverse, &c, &s);
    cs[2 * i] = c;
    cs[2 * i + 1] = s;
  }
  __syncthreads();

  const int H = static_cast<int>(a.q.heads + a.k.heads);
  const int hq = static_cast<int>(a.q.heads);
  // No __restrict__: in place, q.in == q.out. Every element is read and then written by one thread only.
  const T* qin = static_cast<const T*>(a.q.in);
  const T* kin = static_cast<const T*>(a.k.in);
  T* qout = static_cast<T*>(a.q.out);
  T* kout = static_cast<T*>(a.k.out);

  // 2. rotary chunks
  constexpr int U = 2;
  const int cpr = p.chunks_rot;
  const int items = ntok * H * cpr;
  for (int b0 = threadIdx.x; b0 < items; b0 += U * kThreads) {
    V lo[U], hi[U];
    const T* src[U];
    T* dst[U];
    int slot0[U], tl_[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int it = b0 + u * kThreads;
      ok[u] = it < items;
      if (!ok[u]) continue;
      const int c = it % cpr;
      const int rest = it / cpr;
      const int h = rest % H;
      const int tl = rest / H;
      tl_[u] = tl;
      const bool isq = h < hq;
      const int hh = isq ? h : h - hq;
      src[u] = isq ? qin + base[tl].q_in + hh * a.q.in_sh : kin + base[tl].k_in + hh * a.k.in_sh;
      dst[u] = isq ? qout + base[tl].q_out + hh * a.q.out_sh : kout + base[tl].k_out + hh * a.k.out_sh;
      if (GPTJ) {
        slot0[u] = c * (VE / 2);
        lo[u] = *reinterpret_cast<const V*>(src[u] + c * VE);
      } else {
        slot0[u] = c * VE;
        lo[u] = *reinterpret_cast<const V*>(src[u] + c * VE);
        hi[u] = *reinterpret_cast<const V*>(src[u] + n + c * VE);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!ok[u]) continue;
      const F* csr = cs + 2 * (tl_[u] * n + slot0[u]);
      if (GPTJ) {
        V y;
#pragma unroll
        for (int m = 0; m < VE / 2; ++m) {
          F o0, o1;
          rotate_pair<F>(Cvt<T>::load(lo[u].v[2 * m]), Cvt<T>::load(lo[u].v[2 * m + 1]), csr[2 * m], csr[2 * m + 1],
                         &o0, &o1);
          y.v[2 * m] = Cvt<T>::store(o0);
          y.v[2 * m + 1] = Cvt<T>::store(o1);
        }
        *reinterpret_cast<V*>(dst[u] + (slot0[u] * 2)) = y;
      } else {
        V ylo, yhi;
#pragma unroll
        for (int m = 0; m < VE; ++m) {
          F o0, o1;
          rotate_pair<F>(Cvt<T>::load(lo[u].v[m]), Cvt<T>::load(hi[u].v[m]), csr[2 * m], csr[2 * m + 1], &o0, &o1);
          ylo.v[m] = Cvt<T>::store(o0);
          yhi.v[m] = Cvt<T>::store(o1);
        }
        *reinterpret_cast<V*>(dst[u] + slot0[u]) = ylo;
        *reinterpret_cast<V*>(dst[u] + n + slot0[u]) = yhi;
      }
    }
  }

  // 3. passthrough channels (out-of-place only): plain copies, PU independent loads in flight per thread
  //    before any store (a copy has no math to hide the load latency behind).
  const int cpp = p.chunks_pass;
  if (cpp == 0) return;
  const int rd = static_cast<int>(a.rotary_dim);
  const int pitems = ntok * H * cpp;
  constexpr int PU = 4;
  for (int b0 = threadIdx.x; b0 < pitems; b0 += PU * kThreads) {
    const T* ps[PU];
    T* pd[PU];
    V pv[PU];
    T pe[PU];
#pragma unroll
    for (int u = 0; u < PU; ++u) {
      const int it = b0 + u * kThreads;
      if (it >= pitems) continue;
      const int c = it % cpp;
      const int rest = it / cpp;
      const int h = rest % H;
      const int tl = rest / H;
      const bool isq = h < hq;
      const int hh = isq ? h : h - hq;
      ps[u] = isq ? qin + base[tl].q_in + hh * a.q.in_sh : kin + base[tl].k_in + hh * a.k.in_sh;
      pd[u] = isq ? qout + base[tl].q_out + hh * a.q.out_sh : kout + base[tl].k_out + hh * a.k.out_sh;
      if (p.pass_vec) {
        ps[u] += rd + c * VE;
        pd[u] += rd + c * VE;
        pv[u] = *reinterpret_cast<const V*>(ps[u]);
      } else {
        ps[u] += rd + c;
        pd[u] += rd + c;
        pe[u] = *ps[u];
      }
    }
#pragma unroll
    for (int u = 0; u < PU; ++u) {
      if (b0 + u * kThreads >= pitems) continue;
      if (p.pass_vec) *reinterpret_cast<V*>(pd[u]) = pv[u];
      else *pd[u] = pe[u];
    }
  }
}

bool aligned_ptr(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

bool strides_ok(const HeadsView& v, int64_t ve) {
  return v.in_sb % ve == 0 && v.in_ss % ve == 0 && v.in_sh % ve == 0 && v.out_sb % ve == 0 &&
         v.out_ss % ve == 0 && v.out_sh % ve == 0;
}

template <typename T, int VE, int ALIGN, bool GPTJ>
void launch(const RopeArgs& a, cudaStream_t stream) {
  KParams p;
  p.a = a;
  p.n = a.rotary_dim / 2;
  p.chunks_rot = static_cast<int>(GPTJ ? a.rotary_dim / VE : p.n / VE);
  const int64_t npass = a.copy_passthrough ? a.head_dim - a.rotary_dim : 0;
  p.pass_vec = npass % VE == 0;
  p.chunks_pass = static_cast<int>(p.pass_vec ? npass / VE : npass);
  const int64_t H = a.q.heads + a.k.heads;
  const int64_t per_tok = H * (p.chunks_rot + p.chunks_pass);
  int64_t tok = (kItemsPerBlock + per_tok - 1) / (per_tok > 0 ? per_tok : 1);
  using F = typename Cvt<T>::F;
  const int64_t smem_tok = kSmemBudget / (p.n * static_cast<int64_t>(2 * sizeof(F)));
  if (tok > smem_tok) tok = smem_tok;
  if (tok > kMaxTokensPerBlock) tok = kMaxTokensPerBlock;
  if (tok < 1) tok = 1;
  p.tok_per_block = static_cast<int>(tok);
  const size_t smem = static_cast<size_t>(tok) * p.n * 2 * sizeof(F);
  auto kern = rope_kernel<T, VE, ALIGN, GPTJ>;
  if (smem > 48 * 1024)
    PC_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t blocks = (a.tokens + tok - 1) / tok;
  kern<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  PC_CUDA_LAUNCH_CHECK();
}

// Widest vector (16, 8, 4 bytes) that every pointer, stride and channel boundary allows; else scalar
// (neox) or element pairs (gptj).
template <typename T, bool GPTJ>
void dispatch_vec(const RopeArgs& a, cudaStream_t stream) {
  const int64_t n = a.rotary_dim / 2;
  auto fits = [&](int bytes) {
    const int64_t ve = bytes / static_cast<int64_t>(sizeof(T));
    if (ve < (GPTJ ? 2 : 1)) return false;
    if (!aligned_ptr(a.q.in, bytes) || !aligned_ptr(a.q.out, bytes) || !aligned_ptr(a.k.in, bytes) ||
        !aligned_ptr(a.k.out, bytes))
      return false;
    if (!strides_ok(a.q, ve) || !strides_ok(a.k, ve)) return false;
    if ((GPTJ ? a.rotary_dim : n) % ve != 0) return false;
    return true;
  };
  constexpr int S = sizeof(T);
  if (fits(16)) return launch<T, 16 / S, 16, GPTJ>(a, stream);
  if (fits(8)) return launch<T, 8 / S, 8, GPTJ>(a, stream);
  if constexpr (S < 4) {
    if (fits(4)) return launch<T, 4 / S, 4, GPTJ>(a, stream);
  }
  if constexpr (GPTJ) return launch<T, 2, S, GPTJ>(a, stream);
  else return launch<T, 1, S, GPTJ>(a, stream);
}

template <typename T>
void dispatch(const RopeArgs& a, cudaStream_t stream) {
  if (a.gptj) dispatch_vec<T, true>(a, stream);
  else dispatch_vec<T, false>(a, stream);
}

}  // namespace

void rope_apply_cuda(const RopeArgs& a, cudaStream_t stream) {
  if (a.tokens == 0 || a.q.heads + a.k.heads == 0) return;
  PC_CHECK(a.rotary_dim >= 2 && a.rotary_dim % 2 == 0 && a.rotary_dim <= kMaxRotaryDim,
           "rope_apply_cuda: bad rotary_dim ", a.rotary_dim);
  switch (a.dtype) {
    case Dtype::kFloat32: dispatch<float>(a, stream); break;
    case Dtype::kFloat16: dispatch<__half>(a, stream); break;
    case Dtype::kBFloat16: dispatch<__nv_bfloat16>(a, stream); break;
    case Dtype::kFloat64: dispatch<double>(a, stream); break;
  }
}

}  // namespace packcuda::rope
