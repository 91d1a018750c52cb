// CUDA kernels of the causal conv1d.
//
// The conv kernels work on block tiles: a block owns a slab of channels (512 bytes of every row: 256 bf16/fp16,
// 128 fp32, 64 fp64 channels) over a span of tokens, and walks the span in sub-tiles of TT tokens. Each sub-tile's
// rows (plus the K-1 halo rows before it; the backward also the K-1 rows after it) are staged in shared memory
// with 16-byte cp.async copies into a ring of buffers, so that the next sub-tiles load while one computes (the
// forward keeps two in flight, the backward one). The math is the shared per-tile code of conv_math.h reading the
// staged rows: a thread takes P channels (4 or 8 bytes) of a run of consecutive tokens, with its taps loaded once
// for the whole span and its segment and the segment's bounds carried from run to run. Host cu_seqlens of up to
// kInlineCu entries come in the kernel parameters, so the op uploads nothing. A run that lies inside one
// segment, away from its start and end (almost every run of long sequences), takes the straight-line interior
// code (conv_fwd_interior / conv_bwd_interior: no boundary tests, no prefix reads); runs that touch a boundary
// take the general tile walk. The backward keeps each thread's
// dweight/dbias sums in registers over the whole span, reduces them across the block's token groups in a fixed
// order, and writes one partial per (span, channel); conv_reduce_kernel sums the spans in order (deterministic,
// no atomics). Odd C or unaligned rows take the same kernels with element-wise staging and P = 1. The forward stages in
// two buffers where a block cannot have the shared memory of three (fwd_staging_fits: on compute capability 8.6,
// 8.9 and 12.x at K >= 4).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "conv/conv.h"
#include "conv/conv_math.h"
#include "conv/conv_dispatch.h"

namespace packcuda::conv {
namespace {

using detail::dispatch_bool;
using detail::dispatch_dtype;
using detail::dispatch_k;
using detail::shape_of;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowBytes = 512;  // one staged slab row: 32 lanes x 16 bytes

// Slab geometry of storage type S with P channels per thread in the math (P = 1 on the element-wise path).
template <typename S, int P_> struct Slab {
  static constexpr int P = P_;
  static constexpr int kWidth = kRowBytes / static_cast<int>(sizeof(S));  // channels
  static constexpr int kChunk = 16 / static_cast<int>(sizeof(S));  // elements per 16-byte copy
  static constexpr int kAcross = kWidth / (32 * P);  // warps across the slab
  static constexpr int kGroups = kWarps / kAcross;  // token groups (one run each)
  static_assert(kAcross >= 1 && kWarps % kAcross == 0, "slab layout");
};

// The shapes in use (the fastest of the variants, docs/design.md "Block tiles and sub-tile buffering"): forward
// sub-tiles of 64 tokens with 8 bytes of a row per thread in three buffers (two sub-tiles load while one computes;
// two buffers where a block cannot have the shared memory of three, see fwd_staging_fits), backward sub-tiles of 32
// tokens with 4 bytes per thread in two buffers (its window and gradient arrays are twice the forward's registers,
// and its sub-tiles stage x and dy).
template <typename S, bool kVec> struct FwdCfg {
  static constexpr int P = !kVec ? 1 : (sizeof(S) == 8 ? 1 : 8 / static_cast<int>(sizeof(S)));
  static constexpr int TT = 64;
  static constexpr int NB = 4;  // rows per batch of shared-memory loads
  static constexpr int NST = 3;  // sub-tile buffers (NST - 1 sub-tiles load while one computes)
  static constexpr int kSmallNST = 2;
};
template <typename S, bool kVec> struct BwdCfg {
  static constexpr int P = !kVec ? 1 : (sizeof(S) == 2 ? 2 : 1);
  static constexpr int TT = 32;
  static constexpr int NB = 4;
  static constexpr int NST = 2;
};

// Staged rows per sub-tile and dynamic shared bytes (NST buffers) of window size KM.
template <int KM, int TT, int NST> struct Stage {
  static constexpr int kFwdRows = TT + KM - 1;  // x rows [tb - (KM-1), tb + TT)
  static constexpr int kBwdXRows = TT + 2 * KM - 1;  // x rows [tb - KM, tb + TT + KM - 1)
  static constexpr int kBwdDyRows = TT + KM - 1;  // dy rows [tb, tb + TT + KM - 1)
  static constexpr int kFwdBytes = NST * kFwdRows * kRowBytes;
  static constexpr int kBwdBytes = NST * (kBwdXRows + kBwdDyRows) * kRowBytes;
};

// Staged rows u0 .. of one slab (row stride kWidth), read through the conv_math.h row interface.
template <typename S> struct TileRows {
  const S* base;
  int64_t u0, c0;
  __device__ __forceinline__ const S* at(int64_t u, int64_t c) const {
    return base + static_cast<int>(u - u0) * (kRowBytes / static_cast<int>(sizeof(S))) + static_cast<int>(c - c0);
  }
};

// Stage rows [r0, r0 + nrows) x channels [c0, c0 + kWidth) of src [T, C] into dst; rows outside [0, T) and
// channels past C are left as they are (the math never reads them).
template <typename S, bool kVec>
__device__ __forceinline__ void stage_rows(S* dst, const S* src, const ConvShape& sh, int64_t r0, int nrows,
                                           int64_t c0) {
  using L = Slab<S, 1>;
  if constexpr (kVec) {  // C % kChunk == 0 and 16-byte aligned rows: every chunk is wholly inside or outside
    // a thread copies one chunk column (lane) of the rows warp, warp + kWarps, ...
    const int ch = (threadIdx.x & 31) * L::kChunk;
    if (c0 + ch >= sh.C) return;
    const S* from = src + c0 + ch;
    for (int r = threadIdx.x >> 5; r < nrows; r += kWarps) {
      const int64_t u = r0 + r;
      if (u >= 0 && u < sh.T) cuda::cp_async16(dst + r * L::kWidth + ch, from + u * sh.C);
    }
  } else {
    const int n = nrows * L::kWidth;
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const int r = i / L::kWidth, ch = i - r * L::kWidth;
      const int64_t u = r0 + r, c = c0 + ch;
      if (u >= 0 && u < sh.T && c < sh.C) dst[r * L::kWidth + ch] = src[u * sh.C + c];
    }
  }
}

// Host cu_seqlens of a launch (ConvArgs::cu_host), passed by value in the kernel's parameters. The kernels read
// cu through cu_of: the device tensor when there is one, else this parameter (its address is a generic pointer
// into the parameter space, which __grid_constant__ allows without a copy).
struct CuParam {
  int64_t v[kInlineCu];
};
CuParam cu_param(const ConvArgs& a) {
  CuParam p;
  if (a.cu == nullptr && a.cu_host != nullptr) std::memcpy(p.v, a.cu_host, static_cast<size_t>(a.nseg + 1) * 8);
  return p;
}
__device__ __forceinline__ const int64_t* cu_of(const int64_t* cu, const CuParam& param) {
  return cu != nullptr ? cu : param.v;
}

// Token spans: every block of a slab column takes span_len consecutive tokens (a multiple of the sub-tile), and
// there are as many spans as fill one wave of resident blocks (at least one per slab).
struct Spans {
  int64_t count, len;
};
Spans make_spans(int64_t T, int64_t slabs, int blocks_per_sm, int tile) {
  const int64_t slots = static_cast<int64_t>(cuda::sm_count()) * (blocks_per_sm > 0 ? blocks_per_sm : 1);
  int64_t want = slots / slabs;
  if (want < 1) want = 1;
  if (want > 65535) want = 65535;
  const int64_t len = round_up(ceil_div(T > 0 ? T : 1, want), tile);
  return Spans{T > 0 ? ceil_div(T, len) : 0, len};
}

// Resident blocks per SM of a kernel with `smem` dynamic shared bytes (after allowing that much).
template <typename Kernel> int blocks_per_sm(Kernel k, int smem) {
  PC_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int n = 0;
  PC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, kThreads, smem));
  return n;
}

// What a block and a thread of a conv kernel cover: the slab of L::kWidth channels from c0 (blockIdx.x) over
// tokens [s0, s1) of span_len (blockIdx.y) in nsub sub-tiles of TT tokens, and the thread's token group g and
// first channel c.
template <typename L> struct BlockSpan {
  int64_t c0, s0, s1, c;
  int g, nsub;
  __device__ __forceinline__ BlockSpan(const ConvShape& sh, int64_t span_len, int TT) {
    c0 = static_cast<int64_t>(blockIdx.x) * L::kWidth;
    s0 = static_cast<int64_t>(blockIdx.y) * span_len;
    s1 = s0 + span_len < sh.T ? s0 + span_len : sh.T;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    g = warp / L::kAcross;
    c = c0 + ((warp % L::kAcross) * 32 + lane) * L::P;
    nsub = static_cast<int>(ceil_div(s1 - s0, TT));
  }
};

// The buffered walk over a block's sub-tiles: stage(j) issues the copies of sub-tile j (into buffer j % NST),
// NST - 1 sub-tiles ahead of the one computing; once sub-tile j is resident, run(j, tb, t0, t1) gets its first
// token tb and this thread's run [t0, t1) of up to R tokens (token group g; empty at the span's end). Every
// thread takes every barrier.
template <int NST, typename StageFn, typename RunFn>
__device__ __forceinline__ void walk_subtiles(int64_t s0, int64_t s1, int nsub, int TT, int R, int g, StageFn stage,
                                              RunFn run) {
#pragma unroll
  for (int j = 0; j < NST - 1; ++j) {
    if (j < nsub) stage(j);
    cuda::cp_async_commit();
  }
  for (int j = 0; j < nsub; ++j) {
    const int64_t tb = s0 + static_cast<int64_t>(j) * TT;
    if (j + NST - 1 < nsub) stage(j + NST - 1);
    cuda::cp_async_commit();
    cuda::cp_async_wait<NST - 1>();
    __syncthreads();
    const int64_t t0 = tb + static_cast<int64_t>(g) * R;
    const int64_t t1 = t0 + R < s1 ? t0 + R : s1;
    run(j, tb, t0, t1);
    __syncthreads();
  }
}

// A thread's segment and its bounds [lo, hi): first the one holding its first token s0 + lead in its span [s0, s1),
// then moved on run by run (cu is read only when a run enters another segment).
struct SegCursor {
  int64_t seg, lo, hi;
  __device__ __forceinline__ SegCursor(const int64_t* cu, const ConvShape& sh, int64_t s0, int64_t s1, int64_t lead) {
    seg = find_segment(cu, sh.nseg, s0 + lead < s1 ? s0 + lead : s0);
    lo = cu[seg];
    hi = cu[seg + 1];
  }
  __device__ __forceinline__ void reach(const int64_t* cu, int64_t t) {  // to the segment holding token t
    while (hi <= t) {
      ++seg;
      lo = hi;
      hi = cu[seg + 1];
    }
  }
};

template <typename S, int KM, bool kVec, int ACT, bool kExact, int P = FwdCfg<S, kVec>::P, int TT = FwdCfg<S, kVec>::TT,
          int NB = FwdCfg<S, kVec>::NB, int NST = FwdCfg<S, kVec>::NST>
__global__ void __launch_bounds__(kThreads, KM == kMaxK ? 1 : (NST > 2 ? 2 : 3))  // (what the staging allows)
    conv_fwd_kernel(const S* __restrict__ x, const S* __restrict__ w, const S* __restrict__ b,
                    const S* __restrict__ prefix, const int64_t* cu_dev, const __grid_constant__ CuParam cu_inl,
                    ConvShape sh, S* y, int64_t span_len) {
  using L = Slab<S, P>;
  const int64_t* const cu = cu_of(cu_dev, cu_inl);
  constexpr int ROWS = Stage<KM, TT, NST>::kFwdRows, R = TT / L::kGroups;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  S* const buf = reinterpret_cast<S*>(smem_raw);
  const BlockSpan<L> bs(sh, span_len, TT);
  const int64_t c0 = bs.c0, s0 = bs.s0, s1 = bs.s1, c = bs.c;
  const int g = bs.g, nsub = bs.nsub;
  const bool live = c < sh.C;
  const int K = kExact ? KM : sh.K;
  // the thread's taps (loaded once for the span) and its segment: the one holding its current run's first token
  const ConvTaps<S, KM, P> tp(w, b, K, KM - K, live ? c : 0);
  SegCursor seg(cu, sh, s0, s1, static_cast<int64_t>(g) * R);
  auto stage = [&](int j) {
    const int64_t tb = s0 + static_cast<int64_t>(j) * TT;
    stage_rows<S, kVec>(buf + (j % NST) * ROWS * L::kWidth, x, sh, tb - (KM - 1), ROWS, c0);
  };
  walk_subtiles<NST>(s0, s1, nsub, TT, R, g, stage, [&](int j, int64_t tb, int64_t t0, int64_t t1) {
    if (live && t0 < t1) {
      const TileRows<S> rows{buf + (j % NST) * ROWS * L::kWidth, tb - (KM - 1), c0};
      seg.reach(cu, t0);
      if (t1 - t0 == R && t0 - (K - 1) >= seg.lo && t1 <= seg.hi)
        conv_fwd_interior<S, KM, P, R, NB, ACT, kExact>(rows, tp, sh, y + t0 * sh.C + c, sh.C, t0, c);
      else
        conv_fwd_tile<S, KM, P, NB, ACT, kExact>(rows, tp, DensePrefix<S>{prefix, sh.C, K - 1}, cu, sh, y, c, t0, t1,
                                                 seg.seg);
    }
  });
}

// kPre: with a prefix or a prefix gradient to write (dprefix); the kernel without either carries no prefix code,
// which makes its runs at segment boundaries cheaper (docs/design.md "A backward without prefix code": 7 % at 400
// segments).
template <typename S, int KM, bool kVec, int ACT, bool kExact, bool kPre, int P = BwdCfg<S, kVec>::P,
          int TT = BwdCfg<S, kVec>::TT, int NB = BwdCfg<S, kVec>::NB, int NST = BwdCfg<S, kVec>::NST>
__global__ void __launch_bounds__(kThreads, KM == kMaxK ? 1 : 2)
    conv_bwd_kernel(const S* __restrict__ dy, const S* __restrict__ x, const S* __restrict__ w, const S* __restrict__ b,
                    const S* __restrict__ prefix, const int64_t* cu_dev, const __grid_constant__ CuParam cu_inl,
                    ConvShape sh, S* dx, S* dprefix, typename Acc<S>::type* part, int64_t span_len) {
  using L = Slab<S, P>;
  const int64_t* const cu = cu_of(cu_dev, cu_inl);
  using A = typename Acc<S>::type;
  constexpr int XR = Stage<KM, TT, NST>::kBwdXRows, DR = Stage<KM, TT, NST>::kBwdDyRows, STAGE = (XR + DR) * L::kWidth;
  constexpr int R = TT / L::kGroups;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  S* const buf = reinterpret_cast<S*>(smem_raw);
  const BlockSpan<L> bs(sh, span_len, TT);
  const int64_t c0 = bs.c0, s0 = bs.s0, s1 = bs.s1, c = bs.c;
  const int g = bs.g, nsub = bs.nsub;
  auto stage = [&](int j) {
    S* xb = buf + (j % NST) * STAGE;
    const int64_t tb = s0 + static_cast<int64_t>(j) * TT;
    stage_rows<S, kVec>(xb, x, sh, tb - KM, XR, c0);
    stage_rows<S, kVec>(xb + XR * L::kWidth, dy, sh, tb, DR, c0);
  };
  const bool live = c < sh.C;
  const int K = kExact ? KM : sh.K;
  const ConvTaps<S, KM, P> tp(w, b, K, KM - K, live ? c : 0);  // loaded once for the span
  SegCursor seg(cu, sh, s0, s1, static_cast<int64_t>(g) * R);
  A dw[L::P][KM], db[L::P];
  conv_zero_partials(dw, db);
  walk_subtiles<NST>(s0, s1, nsub, TT, R, g, stage, [&](int j, int64_t tb, int64_t t0, int64_t t1) {
    if (live && t0 < t1) {
      const S* xb = buf + (j % NST) * STAGE;
      const TileRows<S> dyr{xb + XR * L::kWidth, tb, c0}, xr{xb, tb - KM, c0};
      seg.reach(cu, t0);
      if (t1 - t0 == R && t0 - K >= seg.lo && t1 + (K - 1) <= seg.hi) {
        conv_bwd_interior<S, KM, P, R, NB, ACT, kExact>(dyr, xr, tp, sh, dx + t0 * sh.C + c, sh.C, t0, c, dw, db);
      } else {
        seg.reach(cu, t1 - 1);  // the walk starts at the run's last token (later runs start after it)
        if constexpr (kPre)
          conv_bwd_tile<S, KM, P, NB, ACT, kExact>(dyr, xr, tp, DensePrefix<S>{prefix, sh.C, K - 1}, cu, sh, dx,
                                                   dprefix, c, t0, t1, seg.seg, dw, db);
        else
          conv_bwd_tile<S, KM, P, NB, ACT, kExact>(dyr, xr, tp, NoPrefix<S>{}, cu, sh, dx, static_cast<S*>(nullptr), c,
                                                   t0, t1, seg.seg, dw, db);
      }
    }
  });
  cuda::cp_async_wait<0>();
  __syncthreads();
  // The block's token groups hold sums of the same channels: add them in group order, one partial per channel.
  static_assert(L::kGroups * L::kWidth * (KM + 1) * sizeof(A) <= Stage<KM, TT, NST>::kBwdBytes,
                "the sums fit the staging memory");
  A* red = reinterpret_cast<A*>(smem_raw);  // [kGroups][kWidth][K + 1]
  const int KP = sh.K + 1;
  if (c < sh.C) conv_store_partials(dw, db, sh.K, red + (g * L::kWidth + static_cast<int>(c - c0)) * KP);
  __syncthreads();
  A* out = part + (static_cast<int64_t>(blockIdx.y) * sh.C + c0) * KP;
  for (int e = threadIdx.x; e < L::kWidth * KP; e += kThreads) {
    if (c0 + e / KP >= sh.C) break;
    A acc = red[e];
    for (int q = 1; q < L::kGroups; ++q) acc += red[q * L::kWidth * KP + e];
    out[e] = acc;
  }
}

// One thread per element e of [C, K+1]: adjacent threads read adjacent partials of a tile (coalesced).
template <typename S>
__global__ void conv_reduce_kernel(const typename Acc<S>::type* part, int64_t ntiles, ConvShape sh, S* dweight,
                                   S* dbias) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < sh.C * (sh.K + 1)) conv_reduce_elem<S>(part, ntiles, sh, dweight, dbias, e);
}

// The vector path needs whole 16-byte chunks in every row and 16-byte aligned tensors.
template <typename S> bool vector_ok(int64_t C, std::initializer_list<const void*> ptrs) {
  if (C % Slab<S, 1>::kChunk != 0) return false;
  for (const void* p : ptrs)
    if (!cuda::aligned(p, 16)) return false;
  return true;
}

template <typename F> void dispatch_conv(const ConvArgs& a, F&& f) {
  dispatch_dtype(a.dtype, [&](auto tag) { dispatch_k(a.K, [&](auto km) { f(tag, km); }); });
}

// The vector path compiles the activation and, where the window size is the kernel size (K = 2, 3, 4, 8), K
// itself into the kernel; the element-wise path reads both at run time.
template <int KM, typename F> void dispatch_vec_math(const ConvArgs& a, F&& f) {
  auto with_act = [&](auto exact) {
    dispatch_bool(a.activation == 1,
                  [&](auto silu) { f(std::integral_constant<int, decltype(silu)::value>{}, exact); });
  };
  if constexpr (KM == 2 || KM == kMaxK) {
    if (a.K != KM) return with_act(std::false_type{});
  }
  with_act(std::true_type{});
}

// Whether the forward's staging of `smem` bytes a block runs on the current device: within the shared memory a
// block may opt in to there (99 KB on compute capability 8.6, 8.9 and 12.x: less than three buffers take at
// KM >= 4), unless PACKCUDA_CONV_SMALL_SMEM (read once; any value but "" and "0") gives every device the small
// staging, for tests.
bool fwd_staging_fits(int smem) {
  static const bool small = [] {
    const char* v = std::getenv("PACKCUDA_CONV_SMALL_SMEM");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return !small && smem <= cuda::smem_per_block_optin();
}

template <typename S, int KM, bool kVec, int ACT, bool kExact, int P, int TT, int NB = FwdCfg<S, kVec>::NB,
          int NST = FwdCfg<S, kVec>::NST>
void launch_fwd(const ConvArgs& a, void* y, cudaStream_t stream) {
  constexpr int smem = Stage<KM, TT, NST>::kFwdBytes;
  // Where these buffers do not fit, kSmallNST of them: the same sub-tiles, runs and per-output math (bitwise the
  // same y), one sub-tile loading while one computes.
  if constexpr (NST != FwdCfg<S, kVec>::kSmallNST) {
    if (!fwd_staging_fits(smem))
      return launch_fwd<S, KM, kVec, ACT, kExact, P, TT, NB, FwdCfg<S, kVec>::kSmallNST>(a, y, stream);
  }
  auto kernel = conv_fwd_kernel<S, KM, kVec, ACT, kExact, P, TT, NB, NST>;
  static const int occ = blocks_per_sm(kernel, smem);
  PC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int64_t slabs = ceil_div(a.C, Slab<S, P>::kWidth);
  const Spans sp = make_spans(a.T, slabs, occ, TT);
  const dim3 grid(static_cast<unsigned>(slabs), static_cast<unsigned>(sp.count));
  kernel<<<grid, kThreads, smem, stream>>>(static_cast<const S*>(a.x), static_cast<const S*>(a.weight),
                                           static_cast<const S*>(a.bias), static_cast<const S*>(a.prefix), a.cu,
                                           cu_param(a), shape_of(a), static_cast<S*>(y), sp.len);
}

// The backward's spans (and so its partial count) follow the vector path's occupancy; the element-wise path
// has slabs and sub-tiles of the same size and reuses them. The spans fill one wave only if every kernel launched
// with them (with or without prefix, K exact or not) reaches that occupancy: today this kernel's is the lowest
// of them (2 blocks per SM for K <= 4, 1 for K = 8). A change that lowers the registers of this one kernel
// alone gives more spans than the others fit, and their launches take more than a wave (docs/design.md "Spans and
// occupancy": the prefix backward 5 to 39 % slower at K = 2 and 3).
template <typename S, int KM, int P, int TT, int NB = BwdCfg<S, true>::NB> Spans bwd_spans(int64_t T, int64_t C) {
  static const int occ = blocks_per_sm(conv_bwd_kernel < S, KM, true, 1, KM != 2 && KM != kMaxK, false, P, TT, NB >,
                                       Stage<KM, TT, BwdCfg<S, true>::NST>::kBwdBytes);
  return make_spans(T, ceil_div(C, Slab<S, P>::kWidth), occ, TT);
}

template <typename S, int KM, bool kVec, int ACT, bool kExact, bool kPre, int P, int TT, int NB = BwdCfg<S, kVec>::NB>
void launch_bwd(const ConvArgs& a, const void* dy, void* dx, void* dprefix, void* work, const Spans& sp,
                cudaStream_t stream) {
  using A = typename Acc<S>::type;
  constexpr int smem = Stage<KM, TT, BwdCfg<S, kVec>::NST>::kBwdBytes;
  auto kernel = conv_bwd_kernel<S, KM, kVec, ACT, kExact, kPre, P, TT, NB>;
  PC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>(ceil_div(a.C, Slab<S, P>::kWidth)), static_cast<unsigned>(sp.count));
  kernel<<<grid, kThreads, smem, stream>>>(
      static_cast<const S*>(dy), static_cast<const S*>(a.x), static_cast<const S*>(a.weight),
      static_cast<const S*>(a.bias), static_cast<const S*>(a.prefix), a.cu, cu_param(a), shape_of(a),
      static_cast<S*>(dx), static_cast<S*>(dprefix), static_cast<A*>(work), sp.len);
}

}  // namespace

int64_t conv_bwd_tiles_cuda(const ConvArgs& a) {
  int64_t n = 0;
  dispatch_conv(a, [&](auto tag, auto km) {
    using S = decltype(tag);
    n = bwd_spans<S, decltype(km)::value, BwdCfg<S, true>::P, BwdCfg<S, true>::TT>(a.T, a.C).count;
  });
  return n;
}

void causal_conv1d_fwd_cuda(const ConvArgs& a, void* y, cudaStream_t stream) {
  if (a.T == 0 || a.C == 0) return;
  dispatch_conv(a, [&](auto tag, auto km) {
    using S = decltype(tag);
    constexpr int KM = decltype(km)::value;
    using V = FwdCfg<S, true>;
    if (vector_ok<S>(a.C, {a.x, y}))
      dispatch_vec_math<KM>(a, [&](auto act, auto exact) {
        launch_fwd<S, KM, true, decltype(act)::value, decltype(exact)::value, V::P, V::TT>(a, y, stream);
      });
    else launch_fwd<S, KM, false, -1, false, 1, FwdCfg<S, false>::TT>(a, y, stream);
  });
  PC_CUDA_LAUNCH_CHECK();
}

void causal_conv1d_bwd_cuda(const ConvArgs& a, const void* dy, void* dx, void* dweight, void* dbias, void* dprefix,
                            void* work, int64_t tiles, cudaStream_t stream) {
  if (dprefix && a.nseg * (a.K - 1) * a.C > 0)
    PC_CUDA_CHECK(cudaMemsetAsync(dprefix, 0, a.nseg * (a.K - 1) * a.C * dtype_size(a.dtype), stream));
  if (a.C == 0) return;
  dispatch_conv(a, [&](auto tag, auto km) {
    using S = decltype(tag);
    using A = typename Acc<S>::type;
    constexpr int KM = decltype(km)::value;
    using V = BwdCfg<S, true>;
    static_assert(BwdCfg<S, false>::TT == V::TT, "both paths share the spans");
    const Spans sp = bwd_spans<S, KM, V::P, V::TT>(a.T, a.C);
    if (sp.count != tiles) throw std::invalid_argument("packcuda conv: inconsistent tile count");
    if (a.T > 0) {
      dispatch_bool(a.prefix != nullptr || dprefix != nullptr, [&](auto pre) {
        constexpr bool kPre = decltype(pre)::value;
        if (vector_ok<S>(a.C, {a.x, dy, dx}))
          dispatch_vec_math<KM>(a, [&](auto act, auto exact) {
            launch_bwd<S, KM, true, decltype(act)::value, decltype(exact)::value, kPre, V::P, V::TT>(a, dy, dx, dprefix,
                                                                                                     work, sp, stream);
          });
        else launch_bwd<S, KM, false, -1, false, kPre, 1, V::TT>(a, dy, dx, dprefix, work, sp, stream);
      });
      PC_CUDA_LAUNCH_CHECK();
    }
    const ConvShape sh = shape_of(a);
    conv_reduce_kernel<S><<<static_cast<unsigned>(ceil_div(a.C * (a.K + 1), 256)), 256, 0, stream>>>(
        static_cast<const A*>(work), sp.count, sh, static_cast<S*>(dweight), static_cast<S*>(dbias));
    PC_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace packcuda::conv
