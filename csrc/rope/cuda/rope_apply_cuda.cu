// Fused rotary application on the GPU. Token-linear grid: a block takes a tile of tokens, computes cos/sin
// of every (token, slot) once into shared memory, then rotates all Hq + Hk heads of q and k with vector
// loads/stores along head_dim (16 bytes where alignment allows). No allocation, no sync.
//
// The pass is memory-bound, so the per-item instruction count decides how many loads stay in flight: each
// thread keeps one vector chunk lane for the whole tile and walks the tile's (token, head) rows with a fixed
// step (no per-item division). With 16-byte chunks the loads run kStages deep through cp.async into shared
// memory (the staged walk); otherwise the next row's loads are issued into registers before the current row
// is rotated and stored (the register walk).
#include <algorithm>
#include <type_traits>

#include "rope/cuda/rope_cuda_common.cuh"

namespace packcuda::rope {
namespace {
using namespace detail;

constexpr int kThreads = 256;
constexpr int kItemsPerBlock = 1024;   // target (token, head, chunk) items per block (larger tiles were slower)
constexpr int kMaxTokensPerBlock = 32;
constexpr int kSmemBudget = 16 * 1024;  // cos/sin table (more only when one token needs it)

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

template <typename T, int VE, int ALIGN, bool GPTJ>
__global__ void __launch_bounds__(kThreads, 4) rope_kernel(const KParams p) {
  using V = Vec<T, VE, ALIGN>;
  using F = typename Elem<T>::compute;  // compute type
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
    base[tl] =
        TokenBase{ti.offset(a.q.in_sb, a.q.in_ss), ti.offset(a.q.out_sb, a.q.out_ss), ti.offset(a.k.in_sb, a.k.in_ss),
                  ti.offset(a.k.out_sb, a.k.out_ss), ti.offset(a.pos_sb, a.pos_ss)};
  }
  __syncthreads();
  // Both staged walks issue their first loads now, so they overlap the cos/sin phase (and the passthrough
  // copies overlap the rotary chunks). Waiting on copy groups counts both walks' groups: a walk may wait for
  // a few of the other's loads early, never too few of its own.
  const int rd = static_cast<int>(a.rotary_dim);
  auto psrc = [&](int tl, int h, int c, const void*& lo, const void*& hi) { lo = hi = row_in(tl, h) + rd + c * VE; };
  StagedWalk sw, pw;
  const bool staged = kStaged && p.rot.lanes == p.rot.chunks;
  const bool pass_staged = kStaged && p.pass_staged;
  int4* stage = reinterpret_cast<int4*>(smem_raw + p.cs_bytes);
  if (staged) sw.start<!GPTJ>(p.rot, ntok, H, stage, src_of);
  if (pass_staged) pw.start<false>(p.pass, ntok, H, stage + 2 * kStages * kThreads, psrc);
  // entry e = m * cpr + c of a token holds slot j = c * NS + m
  fill_cos_sin<F>(
      cs, a, ntok, n, a.inverse, [&](int tl) { return base[tl].pos; },
      [&](int e) {
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
        rotate_pair<F>(Elem<T>::load(lo.v[2 * m]), Elem<T>::load(lo.v[2 * m + 1]), cw.c, cw.s, &o0, &o1);
        y.v[2 * m] = Elem<T>::store(o0);
        y.v[2 * m + 1] = Elem<T>::store(o1);
      }
      *reinterpret_cast<V*>(dst) = y;
    } else {
      V ylo, yhi;
#pragma unroll
      for (int m = 0; m < NS; ++m) {
        const CosSin<F> cw = w[m * cpr];
        F o0, o1;
        rotate_pair<F>(Elem<T>::load(lo.v[m]), Elem<T>::load(hi.v[m]), cw.c, cw.s, &o0, &o1);
        ylo.v[m] = Elem<T>::store(o0);
        yhi.v[m] = Elem<T>::store(o1);
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
    if (p.pass_vec) copy_walk(CopyUnit<V, VE>{});
    else copy_walk(CopyUnit<T, 1>{});
  }
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
  using F = typename Elem<T>::compute;
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

// Widest vector (16, 8, 4 bytes) that every pointer, stride and channel boundary allows; else (0) scalar
// (neox) or element pairs (gptj), aligned to the element.
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
  dispatch_first<16, 8, 4, 0>(fits, [&](auto b) {
    constexpr int B = decltype(b)::value, E = sizeof(T);
    constexpr int VE = B ? B / E : (GPTJ ? 2 : 1);
    if constexpr (VE >= (GPTJ ? 2 : 1)) launch<T, VE, (B ? B : E), GPTJ>(a, stream);  // (else fits(B) is false)
  });
}

template <typename T>
void dispatch(const RopeArgs& a, cudaStream_t stream) {
  dispatch_bool(a.gptj, [&](auto gptj) { dispatch_vec<T, decltype(gptj)::value>(a, stream); });
}

}  // namespace

void rope_apply_cuda(const RopeArgs& a, cudaStream_t stream) {
  if (a.tokens == 0 || a.q.heads + a.k.heads == 0) return;
  PC_CHECK(a.rotary_dim >= 2 && a.rotary_dim % 2 == 0 && a.rotary_dim <= kMaxRotaryDim,
           "rope_apply_cuda: bad rotary_dim ", a.rotary_dim);
  dispatch_dtype(a.dtype, [&](auto tag) { dispatch<decltype(tag)>(a, stream); });
}

}  // namespace packcuda::rope
