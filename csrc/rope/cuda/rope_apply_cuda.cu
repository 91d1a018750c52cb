// Fused rotary application on the GPU. Token-linear grid: a block takes a tile of tokens, computes cos/sin
// of every (token, slot) once into shared memory, then rotates all Hq + Hk heads of q and k with vector
// loads/stores along head_dim (16 bytes where alignment allows). No allocation, no sync.
//
// The pass is memory-bound, so the per-item instruction count decides how many loads stay in flight: each
// thread keeps one vector chunk lane for the whole tile and walks the tile's (token, head) rows with a fixed
// step (no per-item division). With 16-byte chunks the loads run kStages deep through cp.async into shared
// memory (the staged walk); otherwise the next row's loads are issued into registers before the current row
// is rotated and stored (the register walk).
#include <cuda_bf16.h>
#include <algorithm>
#include <type_traits>
#include <cuda_fp16.h>

#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "rope/rope_apply.h"
#include "rope/rope_math.h"

namespace packcuda::rope {
namespace {

constexpr int kThreads = 256;
constexpr int kItemsPerBlock = 1024;   // target (token, head, chunk) items per block (larger tiles were slower)
constexpr int kMaxTokensPerBlock = 32;
constexpr int kSmemBudget = 16 * 1024;  // cos/sin table (more only when one token needs it)

template <typename T> struct Cvt;
template <> struct Cvt<double> {
  using F = double;
  static __device__ __forceinline__ double load(double v) { return v; }
  static __device__ __forceinline__ double store(double f) { return f; }
};
// The CUDA element type of a storage type of common/dispatch.h (the kernels use cuda_bf16 / cuda_fp16 types).
template <typename S> struct NativeOf { using type = S; };
template <> struct NativeOf<bf16_t> { using type = __nv_bfloat16; };
template <> struct NativeOf<f16_t> { using type = __half; };
template <typename S> using Native = typename NativeOf<S>::type;

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

// (cos, sin) of one (token, slot).
template <typename F>
struct alignas(2 * sizeof(F)) CosSin {
  F c, s;
};

struct TokenBase {
  int64_t q_in, q_out, k_in, k_out, pos;
};

// How the threads of a block cover the items (row = (token, head) of the tile, chunk) of one phase: thread
// tid takes chunk lane tid % lanes and rows tid / lanes, + step, + 2 * step, ... (threads with
// tid / lanes >= step idle); a row index advances by step = (dq tokens, dr heads).
struct Walk {
  int chunks;  // chunks per row
  int lanes;   // min(chunks, kThreads)
  int step;    // kThreads / lanes
  int dq, dr;  // step / H, step % H
};

Walk make_walk(int chunks, int64_t H) {
  Walk w;
  w.chunks = chunks;
  w.lanes = chunks < kThreads ? (chunks > 0 ? chunks : 1) : kThreads;
  w.step = kThreads / w.lanes;
  w.dq = static_cast<int>(w.step / H);
  w.dr = static_cast<int>(w.step % H);
  return w;
}

struct KParams {
  RopeArgs a;
  int64_t n;            // rotary_dim / 2
  int tok_per_block;
  Walk rot;             // rotary chunks: VE elements (neox: chunks of the first half, paired with the second)
  Walk pass;            // passthrough channels (out-of-place only; chunks == 0 when not copied)
  bool pass_vec;        // passthrough chunks are vectors of VE elements (else single elements)
  int cs_bytes;         // dynamic shared memory taken by the cos/sin table (16-byte multiple)
  bool pass_staged;     // the passthrough chunks get their own staged walk (buffers after the rotary walk's)
};

// Advances a row cursor (tl, h) by one walk step.
__device__ __forceinline__ void step_row(const Walk& w, int H, int& tl, int& h) {
  tl += w.dq;
  h += w.dr;
  if (h >= H) {
    h -= H;
    ++tl;
  }
}

// A copy unit of the register walk: X, holding W elements.
template <typename X, int W>
struct CopyUnit {
  using type = X;
  static constexpr int width = W;
};

// Runs load(tl, h, c, regs) / store(regs) over this thread's items of a walk; the next item's loads are issued
// before the current item is stored.
template <typename Regs, typename Load, typename Store>
__device__ __forceinline__ void walk_rows(const Walk& w, int ntok, int H, Load load, Store store) {
  const int r0 = threadIdx.x / w.lanes;
  if (r0 >= w.step) return;
  for (int c = threadIdx.x - r0 * w.lanes; c < w.chunks; c += w.lanes) {
    int tl = r0 / H, h = r0 - (r0 / H) * H;
    if (tl >= ntok) return;
    Regs cur;
    load(tl, h, c, cur);
    for (;;) {
      int tl2 = tl, h2 = h;
      step_row(w, H, tl2, h2);
      const bool more = tl2 < ntok;
      Regs nxt;
      if (more) load(tl2, h2, c, nxt);
      store(cur);
      if (!more) break;
      cur = nxt;
      tl = tl2;
      h = h2;
    }
  }
}

// 16-byte asynchronous global -> shared copies (common/cuda_utils.cuh). Each thread reads back only what it
// staged itself, so waiting on its own copy groups is enough (no barrier).
using cuda::cp_async16;
using cuda::cp_async_commit;
using cuda::cp_async_wait;

// The staged walk: like walk_rows for one chunk lane per thread (lanes == chunks), but the loads of the next
// kStages - 1 items are in flight in shared memory (not registers) while one item is consumed. start() issues
// the first kStages - 1 (before the cos/sin phase, so the tile's first loads overlap it); run() the rest.
constexpr int kStages = 4;
struct StagedWalk {
  int4* lo;  // [kStages][kThreads]
  int4* hi;  // [kStages][kThreads] (neox partner chunks)
  int c, itl, ih, ctl, ch;
  bool active;

  template <bool TWO, typename Src>
  __device__ __forceinline__ void issue(const Walk& w, int ntok, int H, int slot, Src src) {
    if (itl < ntok) {
      const void *a, *b;
      src(itl, ih, c, a, b);
      cp_async16(lo + slot * kThreads + threadIdx.x, a);
      if (TWO) cp_async16(hi + slot * kThreads + threadIdx.x, b);
      step_row(w, H, itl, ih);
    }
    cp_async_commit();
  }
  template <bool TWO, typename Src>
  __device__ __forceinline__ void start(const Walk& w, int ntok, int H, int4* stage, Src src) {
    lo = stage;
    hi = stage + kStages * kThreads;
    const int r0 = threadIdx.x / w.lanes;
    active = r0 < w.step;
    c = threadIdx.x - r0 * w.lanes;
    itl = ctl = r0 / H;
    ih = ch = r0 - (r0 / H) * H;
    if (!active) itl = ctl = ntok;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue<TWO>(w, ntok, H, s, src);
  }
  template <bool TWO, typename Src, typename Consume>
  __device__ __forceinline__ void run(const Walk& w, int ntok, int H, Src src, Consume consume) {
    for (int k = 0; ctl < ntok; ++k) {
      issue<TWO>(w, ntok, H, (k + kStages - 1) % kStages, src);
      cp_async_wait<kStages - 1>();
      const int slot = k % kStages;
      consume(ctl, ch, c, lo + slot * kThreads + threadIdx.x, hi + slot * kThreads + threadIdx.x);
      step_row(w, H, ctl, ch);
    }
    cp_async_wait<0>();
  }
};

// cos/sin of every (token, slot) of a tile into the shared table cs [ntok][n] (n = rotary_dim / 2): entry e of
// local token tl holds slot slot_of(e) (each kernel's layout, read conflict-free by its lanes; consecutive
// threads store consecutive entries); pos_base(tl) is the token's offset into the positions.
template <typename F, typename PosBase, typename SlotOf>
__device__ __forceinline__ void fill_cos_sin(CosSin<F>* cs, const RopeArgs& a, int ntok, int n, bool inverse,
                                             PosBase pos_base, SlotOf slot_of) {
  for (int i = threadIdx.x; i < ntok * n; i += blockDim.x) {
    const int tl = i / n, j = slot_of(i - tl * n);
    const int r = slot_axis(j, a.layout, a.section[0], a.section[1], a.section[2]);
    const int64_t off = r * a.pos_row_stride + pos_base(tl);
    const int64_t pos = a.pos_int64 ? __ldg(static_cast<const long long*>(a.pos) + off)
                                    : __ldg(static_cast<const int*>(a.pos) + off);
    CosSin<F> w;
    rope_cos_sin(rope_angle(pos, __ldg(a.inv_freq + j)), static_cast<F>(a.scaling), inverse, &w.c, &w.s);
    cs[i] = w;
  }
}

template <typename T, int VE, int ALIGN, bool GPTJ>
__global__ void __launch_bounds__(kThreads, 4) rope_kernel(const KParams p) {
  using V = Vec<T, VE, ALIGN>;
  using F = typename Cvt<T>::F;  // compute type
  constexpr int NS = GPTJ ? (VE >= 2 ? VE / 2 : 1) : VE;  // frequency slots per chunk (gptj needs VE >= 2)
  constexpr bool kStaged = ALIGN == 16 && VE * sizeof(T) == 16;
  const RopeArgs& a = p.a;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // cos/sin of slot j = c * NS + m of local token tl at [(tl * NS + m) * chunks + c]: the lanes of a warp
  // (consecutive chunks c) read consecutive pairs. The staged walk's buffers follow (p.cs_bytes on).
  CosSin<F>* cs = reinterpret_cast<CosSin<F>*>(smem_raw);
  __shared__ TokenBase base[kMaxTokensPerBlock];

  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * p.tok_per_block;
  const int ntok = static_cast<int>(min(static_cast<int64_t>(p.tok_per_block), a.tokens - t0));
  const int n = static_cast<int>(p.n);
  const int cpr = p.rot.chunks;
  const int H = static_cast<int>(a.q.heads + a.k.heads);
  const int hq = static_cast<int>(a.q.heads);
  // No __restrict__: in place, q.in == q.out. Every element is read and then written by one thread only.
  const T* qin = static_cast<const T*>(a.q.in);
  const T* kin = static_cast<const T*>(a.k.in);
  T* qout = static_cast<T*>(a.q.out);
  T* kout = static_cast<T*>(a.k.out);
  // row (tl, h) -> input / output pointers of the head
  auto row_in = [&](int tl, int h) {
    return h < hq ? qin + base[tl].q_in + h * a.q.in_sh : kin + base[tl].k_in + (h - hq) * a.k.in_sh;
  };
  auto row_out = [&](int tl, int h) {
    return h < hq ? qout + base[tl].q_out + h * a.q.out_sh : kout + base[tl].k_out + (h - hq) * a.k.out_sh;
  };
  const int hoff = GPTJ ? 0 : n;  // neox: the partner chunk sits n channels later
  auto src_of = [&](int tl, int h, int c, const void*& lo, const void*& hi) {
    const T* s = row_in(tl, h) + c * VE;
    lo = s;
    hi = s + hoff;
  };

  // 1. the tile's token base offsets; the staged walk's first loads; cos/sin of every (token, slot) of the tile.
  for (int tl = threadIdx.x; tl < ntok; tl += kThreads) {
    const TokenIndex ti(t0 + tl, a.seq);
    base[tl] = TokenBase{ti.offset(a.q.in_sb, a.q.in_ss), ti.offset(a.q.out_sb, a.q.out_ss),
                         ti.offset(a.k.in_sb, a.k.in_ss), ti.offset(a.k.out_sb, a.k.out_ss),
                         ti.offset(a.pos_sb, a.pos_ss)};
  }
  __syncthreads();
  // Both staged walks issue their first loads now, so they overlap the cos/sin phase (and the passthrough
  // copies overlap the rotary chunks). Waiting on copy groups counts both walks' groups: a walk may wait for
  // a few of the other's loads early, never too few of its own.
  const int rd = static_cast<int>(a.rotary_dim);
  auto psrc = [&](int tl, int h, int c, const void*& lo, const void*& hi) {
    lo = hi = row_in(tl, h) + rd + c * VE;
  };
  StagedWalk sw, pw;
  const bool staged = kStaged && p.rot.lanes == p.rot.chunks;
  const bool pass_staged = kStaged && p.pass_staged;
  int4* stage = reinterpret_cast<int4*>(smem_raw + p.cs_bytes);
  if (staged) sw.start<!GPTJ>(p.rot, ntok, H, stage, src_of);
  if (pass_staged) pw.start<false>(p.pass, ntok, H, stage + 2 * kStages * kThreads, psrc);
  // entry e = m * cpr + c of a token holds slot j = c * NS + m
  fill_cos_sin<F>(cs, a, ntok, n, a.inverse, [&](int tl) { return base[tl].pos; }, [&](int e) {
    const int m = e / cpr;
    return (e - m * cpr) * NS + m;
  });
  __syncthreads();

  // 2. rotary chunks: rotate (lo, hi) of row (tl, h), chunk c, and store.
  auto rotate_store = [&](int tl, int h, int c, const V& lo, const V& hi) {
    const CosSin<F>* w = cs + tl * NS * cpr + c;
    T* dst = row_out(tl, h) + c * VE;
    if (GPTJ) {
      V y;
#pragma unroll
      for (int m = 0; m < NS; ++m) {
        const CosSin<F> cw = w[m * cpr];
        F o0, o1;
        rotate_pair<F>(Cvt<T>::load(lo.v[2 * m]), Cvt<T>::load(lo.v[2 * m + 1]), cw.c, cw.s, &o0, &o1);
        y.v[2 * m] = Cvt<T>::store(o0);
        y.v[2 * m + 1] = Cvt<T>::store(o1);
      }
      *reinterpret_cast<V*>(dst) = y;
    } else {
      V ylo, yhi;
#pragma unroll
      for (int m = 0; m < NS; ++m) {
        const CosSin<F> cw = w[m * cpr];
        F o0, o1;
        rotate_pair<F>(Cvt<T>::load(lo.v[m]), Cvt<T>::load(hi.v[m]), cw.c, cw.s, &o0, &o1);
        ylo.v[m] = Cvt<T>::store(o0);
        yhi.v[m] = Cvt<T>::store(o1);
      }
      *reinterpret_cast<V*>(dst) = ylo;
      *reinterpret_cast<V*>(dst + hoff) = yhi;
    }
  };
  if (kStaged && staged) {
    sw.run<!GPTJ>(p.rot, ntok, H, src_of, [&](int tl, int h, int c, const int4* lo, const int4* hi) {
      V l = *reinterpret_cast<const V*>(lo), hh;
      if (!GPTJ) hh = *reinterpret_cast<const V*>(hi);
      rotate_store(tl, h, c, l, hh);
    });
  } else {
    struct Rot {
      V lo, hi;
      int tl, h, c;
    };
    walk_rows<Rot>(
        p.rot, ntok, H,
        [&](int tl, int h, int c, Rot& r) {
          const T* src = row_in(tl, h) + c * VE;
          r.lo = *reinterpret_cast<const V*>(src);
          if (!GPTJ) r.hi = *reinterpret_cast<const V*>(src + hoff);
          r.tl = tl;
          r.h = h;
          r.c = c;
        },
        [&](const Rot& r) { rotate_store(r.tl, r.h, r.c, r.lo, r.hi); });
  }

  // 3. passthrough channels (out-of-place only): plain copies.
  if (p.pass.chunks == 0) return;
  if (pass_staged) {
    pw.run<false>(p.pass, ntok, H, psrc, [&](int tl, int h, int c, const int4* v, const int4*) {
      *reinterpret_cast<int4*>(row_out(tl, h) + rd + c * VE) = *v;
    });
  } else {
    // register walk: 16-byte vectors when the strides allow, single elements otherwise
    auto copy_walk = [&](auto unit) {
      using E = typename decltype(unit)::type;
      constexpr int width = decltype(unit)::width;
      struct Copy {
        E v;
        T* dst;
      };
      walk_rows<Copy>(
          p.pass, ntok, H,
          [&](int tl, int h, int c, Copy& r) {
            r.v = *reinterpret_cast<const E*>(row_in(tl, h) + rd + c * width);
            r.dst = row_out(tl, h) + rd + c * width;
          },
          [&](const Copy& r) { *reinterpret_cast<E*>(r.dst) = r.v; });
    };
    if (p.pass_vec)
      copy_walk(CopyUnit<V, VE>{});
    else
      copy_walk(CopyUnit<T, 1>{});
  }
}


bool strides_ok(const HeadsView& v, int64_t ve) {
  return v.in_sb % ve == 0 && v.in_ss % ve == 0 && v.in_sh % ve == 0 && v.out_sb % ve == 0 &&
         v.out_ss % ve == 0 && v.out_sh % ve == 0;
}

template <typename T, int VE, int ALIGN, bool GPTJ>
void launch(const RopeArgs& a, cudaStream_t stream) {
  KParams p;
  p.a = a;
  p.n = a.rotary_dim / 2;
  const int64_t H = a.q.heads + a.k.heads;
  const int chunks_rot = static_cast<int>(GPTJ ? a.rotary_dim / VE : p.n / VE);
  const int64_t npass = a.copy_passthrough ? a.head_dim - a.rotary_dim : 0;
  p.pass_vec = npass % VE == 0;
  const int chunks_pass = static_cast<int>(p.pass_vec ? npass / VE : npass);
  p.rot = make_walk(chunks_rot, H);
  p.pass = make_walk(chunks_pass, H);
  const int64_t per_tok = H * (chunks_rot + chunks_pass);
  int64_t tok = (kItemsPerBlock + per_tok - 1) / (per_tok > 0 ? per_tok : 1);
  using F = typename Cvt<T>::F;
  constexpr bool staged = ALIGN == 16 && VE * sizeof(T) == 16;
  constexpr size_t stage_bytes = staged ? 2 * kStages * kThreads * sizeof(int4) : 0;
  const int64_t smem_tok = kSmemBudget / (p.n * static_cast<int64_t>(sizeof(CosSin<F>)));
  if (tok > smem_tok) tok = smem_tok;
  if (tok > kMaxTokensPerBlock) tok = kMaxTokensPerBlock;
  if (tok < 1) tok = 1;
  p.tok_per_block = static_cast<int>(tok);
  const size_t cs_bytes = (static_cast<size_t>(tok) * p.n * sizeof(CosSin<F>) + 15) / 16 * 16;
  p.cs_bytes = static_cast<int>(cs_bytes);
  p.pass_staged = staged && p.pass_vec && chunks_pass > 0 && p.pass.lanes == p.pass.chunks;
  const size_t smem = cs_bytes + stage_bytes + (p.pass_staged ? kStages * kThreads * sizeof(int4) : 0);
  auto kern = rope_kernel<T, VE, ALIGN, GPTJ>;
  // above 48 KB of static + dynamic shared memory a kernel must opt in
  if (smem + sizeof(TokenBase) * kMaxTokensPerBlock > 48 * 1024)
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
    if (!cuda::aligned(a.q.in, bytes) || !cuda::aligned(a.q.out, bytes) || !cuda::aligned(a.k.in, bytes) ||
        !cuda::aligned(a.k.out, bytes))
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
  dispatch_bool(a.gptj, [&](auto gptj) { dispatch_vec<T, decltype(gptj)::value>(a, stream); });
}


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
// structure instead, one warp per token (qk_norm_fwd_wtok_kernel, qk_norm_bwd_wtok_kernel below): a warp walks
// all q then k heads of each of its tokens, a fixed number of rows per step, with its loads issued steps ahead
// into registers and the token's cos/sin in a per-warp table; the two kernels share the lane layout, the walk,
// the table, the gains and the row addressing. The tile kernel runs everything else.
// ===================================================================================================
namespace norm {

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

// Two consecutive (cos, sin) entries of one unit: one 16-byte shared load (two for fp64).
template <typename F>
struct alignas(16) CosSin2 {
  CosSin<F> a, b;
};

template <typename F>
__device__ __forceinline__ F group_sum(F v, int G) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    if (off < G) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <typename T, int VE, int ALIGN, int UPL, bool GPTJ, bool BWD, int NK>
__global__ void __launch_bounds__(kNThreads, BWD ? (UPL == 1 ? 2 : 1) : (UPL == 1 ? 3 : 2)) qk_norm_kernel(const NParams p) {
  using V = Vec<T, VE, ALIGN>;
  using F = typename Cvt<T>::F;
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
  auto round = [](F v) { return Cvt<T>::load(Cvt<T>::store(v)); };
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
    fill_cos_sin<F>(cs, r, ntok, n, BWD, [&](int tl) { return base[tl].pos; }, [&](int e) {
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
            x[i][s][m] = load ? Cvt<T>::load(xv.v[m]) : F(0);
            if constexpr (BWD) g[i][s][m] = load ? Cvt<T>::load(gv.v[m]) : F(0);
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
            y0.v[m] = Cvt<T>::store(nv[0][m]);
            if (!GPTJ) y1.v[m] = Cvt<T>::store(nv[1][m]);
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
            for (int m = 0; m < VE; ++m) y.v[m] = Cvt<T>::store(norm_dx_of(g[i][s][m], x[i][s][m], rstd, dot_d));
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
// dw[c] = sum over blocks b (in order) of part[b][c], c over the 2 * D channels of q and k.
template <typename F>
__global__ void __launch_bounds__(kNThreads) reduce_partials(const F* part, int nblocks, int D, F* dw_q, F* dw_k) {
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
    if (c < D) dw_q[c] = t;
    else dw_k[c - D] = t;
  }
}

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
constexpr int kWtokFwdAhead = 2;         // forward: steps whose loads are issued ahead of the math (A; a step
                                         // reads 1 KB per warp; the fastest of the variants, docs/design.md
                                         // "Look-ahead of the forward")
constexpr int kWtokFwdMinBlocks = 3;     // forward: blocks per SM the registers are bounded for (80 registers)

struct WParams {
  NormArgs a;
  int hq, hk;          // q heads, k heads
  int sq, steps;       // warp steps of a token over its q heads (ceil(hq / RW)) and over its q and k heads
  int n, P;            // rotary_dim / 2, rotary lanes of a row (n / 8)
  int64_t ntok;        // tokens
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

// 8 elements of a 16-byte vector <-> fp32 (exact widening; rounding to nearest even when narrowing, as Cvt).
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
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
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
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
__device__ __forceinline__ void wtok_table(CosSin<float>* tab, const RopeArgs& r, const WCur& c, int n, int P,
                                           int lane, bool inverse) {
  const float scaling = static_cast<float>(r.scaling);
  const int64_t pb = c.b * r.pos_sb + c.s * r.pos_ss;
  __syncwarp();
  for (int e = lane; e < n; e += 32) {
    const int q2 = e >> 1, mp = q2 / P, u = q2 - mp * P;
    const int j = u * 8 + 2 * mp + (e & 1);
    const int ax = slot_axis(j, r.layout, r.section[0], r.section[1], r.section[2]);
    const int64_t off = ax * r.pos_row_stride + pb;
    const int64_t pos = r.pos_int64 ? __ldg(static_cast<const long long*>(r.pos) + off)
                                    : __ldg(static_cast<const int*>(r.pos) + off);
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
// warps summed in warp order (shared memory) into its [2, D] partial, and reduce_partials sums the partials in
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
  __shared__ __align__(16) float gsm[2][D];                // gains of q, k: w (rms) or 1 + w (rms_offset)
  __shared__ __align__(16) float red[WPB][2][D];           // the warps' weight-gradient sums
  __shared__ __align__(16) CosSin<float> cst[WPB][D / 2];  // each warp's cos/sin of its current token
  const W w(p);
  const float eps = static_cast<float>(a.eps);
  auto round = [](float v) { return Cvt<T>::load(Cvt<T>::store(v)); };
  wtok_gains<D, NK>(gsm, a);

  // the step's loads: x and the gradient, two vectors each (zeros for an idle row slot)
  auto issue = [&](const WCur& c, uint4 (&b)[4]) {
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
  auto math = [&](const uint4 (&b)[4], const WCur& c, auto ph_c) {
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
  wtok_walk<1>(w, buf, issue, [&](const uint4 (&b)[4], const WCur& c) {
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
  reduce_partials<float><<<static_cast<unsigned>((2 * D + 31) / 32), kNThreads, 0, stream>>>(
      static_cast<const float*>(a.workspace), blocks, D, static_cast<float*>(a.dw_q), static_cast<float*>(a.dw_k));
  PC_CUDA_LAUNCH_CHECK();
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
  __shared__ __align__(16) float gsm[2][D];                       // gains of q, k: w (rms) or 1 + w (rms_offset)
  __shared__ __align__(16) CosSin<float> cst[kWtokWarps][D / 2];  // each warp's cos/sin of its current token
  const WTok<D> w(p);
  const float eps = static_cast<float>(a.eps);
  auto round = [](float v) { return Cvt<T>::load(Cvt<T>::store(v)); };
  wtok_gains<D, NK>(gsm, a);

  // the step's loads: x, two vectors (zeros for an idle row slot)
  auto issue = [&](const WCur& c, uint4 (&b)[2]) {
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
  auto step = [&](const uint4 (&b)[2], const WCur& c) {
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

// The warp-per-token kernel where it applies (2-byte types on the 16-byte vector path, neox; the caller checks
// those): head_dim 64, 128 or 256 and rotary_dim a multiple of 16. Returns whether it ran.
template <typename T, int NK>
bool try_wtok(const NormArgs& a, bool bwd, cudaStream_t stream) {
  const int64_t D = a.r.head_dim;
  if (a.r.rotary_dim % 16 != 0) return false;
  auto go = [&](auto d_c) {
    constexpr int DD = decltype(d_c)::value;
    if (bwd) launch_wtok_bwd<T, DD, NK>(a, stream);
    else launch_wtok_fwd<T, DD, NK>(a, stream);
    return true;
  };
  if (D == 64) return go(std::integral_constant<int, 64>{});
  if (D == 128) return go(std::integral_constant<int, 128>{});
  if (D == 256) return go(std::integral_constant<int, 256>{});
  return false;
}

template <typename T, int VE, int ALIGN, int UPL, bool GPTJ, int NK>
void launch(const NormArgs& a, int U, int P, int G, bool bwd, cudaStream_t stream) {
  using F = typename Cvt<T>::F;
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
      PC_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(cs_bytes)));
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
  reduce_partials<F><<<static_cast<unsigned>((2 * D + 31) / 32), kNThreads, 0, stream>>>(
      static_cast<const F*>(a.workspace), blocks, D, static_cast<F*>(a.dw_q), static_cast<F*>(a.dw_k));
  PC_CUDA_LAUNCH_CHECK();
}

// Units per row -> (UPL, G): the smallest UPL of the instantiated ones with U <= 32 * UPL, G the smallest
// power of two with G * UPL >= U.
template <typename T, int VE, int ALIGN, bool GPTJ, int NK, int... UPLS>
void launch_upl(const NormArgs& a, int U, int P, bool bwd, cudaStream_t stream) {
  bool done = false;
  auto one = [&](auto upl_c) {
    constexpr int UPL = decltype(upl_c)::value;
    if (done || U > 32 * UPL) return;
    int G = 1;
    while (G * UPL < U) G <<= 1;
    launch<T, VE, ALIGN, UPL, GPTJ, NK>(a, U, P, G, bwd, stream);
    done = true;
  };
  (one(std::integral_constant<int, UPLS>{}), ...);
  PC_CHECK(done, "qk_norm_rope_cuda: ", U, " units per row exceed the kernel's registers");
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
    auto by_kind = [&](auto nk) {
      constexpr int NK = decltype(nk)::value;
      if constexpr (S == 2 && !GPTJ) {
        if (try_wtok<T, NK>(a, bwd, stream)) return;
      }
      if constexpr (S == 8) launch_upl<T, VE16, 16, GPTJ, NK, 1, 4, 16>(a, U, P, bwd, stream);
      else launch_upl<T, VE16, 16, GPTJ, NK, 1, 4>(a, U, P, bwd, stream);
    };
    if (a.norm == kNormRms) return by_kind(std::integral_constant<int, kNormRms>{});
    return by_kind(std::integral_constant<int, kNormRmsOffset>{});
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
  dispatch_dtype(a.r.dtype, [&](auto tag) { by_style<Native<decltype(tag)>>(a, bwd, stream); });
}

}  // namespace norm
}  // namespace

void rope_apply_cuda(const RopeArgs& a, cudaStream_t stream) {
  if (a.tokens == 0 || a.q.heads + a.k.heads == 0) return;
  PC_CHECK(a.rotary_dim >= 2 && a.rotary_dim % 2 == 0 && a.rotary_dim <= kMaxRotaryDim,
           "rope_apply_cuda: bad rotary_dim ", a.rotary_dim);
  dispatch_dtype(a.dtype, [&](auto tag) { dispatch<Native<decltype(tag)>>(a, stream); });
}

void qk_norm_rope_cuda(const NormArgs& a, cudaStream_t stream) { norm::run(a, false, stream); }

void qk_norm_rope_backward_cuda(const NormArgs& a, cudaStream_t stream) { norm::run(a, true, stream); }

}  // namespace packcuda::rope
