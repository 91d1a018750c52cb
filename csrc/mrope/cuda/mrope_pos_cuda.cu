// mRoPE position ids on the GPU, two kernels whatever the number of blocks, no host synchronization:
//   1. count:     every warp takes a tile of kTile tokens and counts the runs starting in it (per modality) and
//                 its latest run start; for every segment starting in the tile it records the runs before the
//                 segment start inside the tile. Also initializes deltas and the status word. The last block to
//                 finish (a counter the host uploads as 0 with the block table) scans the tile counts (exclusive,
//                 in place), turns the segment records into the runs before every segment and checks the total
//                 run counts against the blocks.
//   2. positions: every warp rescans its tile from the tile's prefix, 32 tokens a step (ballots: run starts,
//                 counts and the latest run start of every lane), and writes the positions (mrope_positions),
//                 text_pos, the per-segment maxima (integer atomicMax: order-independent) and checks every run
//                 at its last token (error keys combined with atomicMin: the earliest error wins).
// Only ids are read per token (twice) and only the outputs are written per token: no per-token scratch. Every
// result is independent of the order in which blocks run.
#include "common/cuda_utils.cuh"
#include "mrope/mrope_pos.h"
#include "mrope/mrope_pos_math.h"

namespace packcuda::rope {
namespace {

constexpr int kWarps = 8;  // warps per block of the tile kernels
constexpr int kThreads = 32 * kWarps;
constexpr int kSteps = 8;  // 32-token steps per warp tile
constexpr int64_t kTile = 32 * kSteps;
constexpr unsigned kAll = 0xFFFFFFFFu;

int64_t num_tiles(int64_t total) { return (total + kTile - 1) / kTile; }

__device__ __forceinline__ unsigned lanes_below(int lane) { return (1u << lane) - 1u; }
__device__ __forceinline__ unsigned lanes_upto(int lane) { return static_cast<unsigned>((2ull << lane) - 1ull); }
__device__ __forceinline__ int64_t last_lane_token(int64_t b, unsigned mask) { return b + 31 - __clz(mask); }

// The segment of the warp's current 32 tokens, the same in every lane while no segment boundary falls inside
// the step. A step crossing a boundary looks up each lane's segment (rare: once per segment end).
struct SegCursor {
  int64_t seg, a, end;
  __device__ void at(const MRopeTables& tb, int64_t t) {
    seg = find_segment(tb.cu, tb.nseg, t);
    a = tb.cu[seg];
    end = tb.cu[seg + 1];
  }
  // Moves to token t (>= the tokens seen so far) of a step starting at b; returns whether lanes looked up.
  __device__ bool step(const MRopeTables& tb, int64_t b, int64_t t, int64_t total) {
    const int64_t last = b + 31 < total ? b + 31 : total - 1;
    if (end > last) return false;  // warp-uniform: no boundary in this step
    if (t < total) at(tb, t);
    return true;
  }
  __device__ void take_lane(int src) {
    seg = __shfl_sync(kAll, seg, src);
    a = __shfl_sync(kAll, a, src);
    end = __shfl_sync(kAll, end, src);
  }
};

template <typename I>
__device__ __forceinline__ void load_types(int (&ty)[kSteps], const I* __restrict__ ids, int64_t t0, int lane,
                                           int64_t total, const MRopeTables& tb) {
  I v[kSteps];
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int64_t t = t0 + k * 32 + lane;
    v[k] = t < total ? ids[t] : I(0);
  }
#pragma unroll
  for (int k = 0; k < kSteps; ++k) ty[k] = t0 + k * 32 + lane < total ? token_type(static_cast<int64_t>(v[k]), tb) : 0;
}

template <typename I>
__device__ __forceinline__ int type_at(const I* ids, int64_t t, int64_t total, const MRopeTables& tb) {
  return t >= 0 && t < total ? token_type(static_cast<int64_t>(ids[t]), tb) : 0;
}

// A warp's walk over its tile, 32 tokens a step: the segment cursor, the runs started so far per modality, the
// latest run start and the type of the token before the step. Both tile kernels take the same steps: begin()
// finds each lane's segment and the run starts of the step (ballots), finish() folds the step in.
struct TileWalk {
  SegCursor cur;
  int64_t n_img = 0, n_vid = 0, latest = -1;
  int prev_last = 0;
  struct Step {
    int64_t b, t;
    SegCursor my;  // the lane's segment
    bool moved;    // warp-uniform: a segment boundary falls inside the step
    unsigned bi, bv;  // lanes starting an image / video run
  };
  __device__ Step begin(int ty, int64_t b, int lane, int64_t total, const MRopeTables& tb) const {
    Step s;
    s.b = b;
    s.t = b + lane;
    s.my = cur;
    s.moved = s.my.step(tb, b, s.t, total);
    int prev = __shfl_up_sync(kAll, ty, 1);
    if (lane == 0) prev = prev_last;
    const bool start = s.t < total && mrope_is_run_start(ty, prev, s.t == s.my.a);
    s.bi = __ballot_sync(kAll, start && ty == 1);
    s.bv = __ballot_sync(kAll, start && ty == 2);
    return s;
  }
  __device__ void finish(const Step& s, int ty) {
    n_img += __popc(s.bi);
    n_vid += __popc(s.bv);
    if (s.bi | s.bv) latest = last_lane_token(s.b, s.bi | s.bv);
    prev_last = __shfl_sync(kAll, ty, 31);
    if (s.moved) {
      cur = s.my;
      cur.take_lane(31);
    }
  }
};

// Inclusive scan of (counts, latest start) over the lanes of a warp.
__device__ __forceinline__ MRopeScan warp_scan(MRopeScan v, int lane) {
  const MRopeScanOp op;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const MRopeScan u{__shfl_up_sync(kAll, v.counts, d), __shfl_up_sync(kAll, v.start, d)};
    if (lane >= d) v = op(u, v);
  }
  return v;
}

// One block (kThreads): exclusive scan of the tile counts in place, each thread a run of consecutive tiles read
// kGroup at a time (independent loads in flight), then the runs before every nonempty segment; checks the total
// run counts against the blocks. Reads bypass L1: other blocks wrote the data.
constexpr int kGroup = 8;
__device__ void scan_tiles(MRopeScan* tiles, int64_t ntiles, MRopeScan* seg_base, int64_t* status, int64_t total,
                           const MRopeTables& tb) {
  __shared__ MRopeScan warp_sums[kWarps];
  const MRopeScanOp op;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t per = (ntiles + kThreads - 1) / kThreads;
  const int64_t lo0 = threadIdx.x * per;
  const int64_t lo = lo0 < ntiles ? lo0 : ntiles;
  const int64_t hi = lo + per < ntiles ? lo + per : ntiles;
  MRopeScan acc{0, -1};
  for (int64_t g = lo; g < hi; g += kGroup) {
    MRopeScan v[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      v[j] = MRopeScan{0, -1};
      if (g + j < hi) {
        v[j].counts = __ldcg(&tiles[g + j].counts);
        v[j].start = __ldcg(&tiles[g + j].start);
      }
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) acc = op(acc, v[j]);
  }
  const MRopeScan incl = warp_scan(acc, lane);
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const MRopeScan w = warp_scan(lane < kWarps ? warp_sums[lane] : MRopeScan{0, -1}, lane);
    __syncwarp();
    if (lane < kWarps) warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  // exclusive prefix of this thread's first tile: earlier warps, then earlier lanes of this warp
  MRopeScan excl = warp > 0 ? warp_sums[warp - 1] : MRopeScan{0, -1};
  const MRopeScan lanes_before{__shfl_up_sync(kAll, incl.counts, 1), __shfl_up_sync(kAll, incl.start, 1)};
  if (lane > 0) excl = op(excl, lanes_before);
  for (int64_t g = lo; g < hi; g += kGroup) {
    MRopeScan v[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j)
      if (g + j < hi) v[j] = MRopeScan{__ldcg(&tiles[g + j].counts), __ldcg(&tiles[g + j].start)};
#pragma unroll
    for (int j = 0; j < kGroup; ++j)
      if (g + j < hi) {
        tiles[g + j] = excl;
        excl = op(excl, v[j]);
      }
  }
  __syncthreads();  // every tile prefix written (and visible to the block) before the segments read them
  for (int64_t s = threadIdx.x; s < tb.nseg; s += kThreads) {
    const int64_t a = tb.cu[s];
    if (a < tb.cu[s + 1]) seg_base[s] = MRopeScan{__ldcg(&tiles[a / kTile].counts) + __ldcg(&seg_base[s].counts), -1};
  }
  if (threadIdx.x == 0) {
    const int64_t key = mrope_check_counts(warp_sums[kWarps - 1], tb, total);
    if (key != kMRopeOk) atomicMin(reinterpret_cast<long long*>(status), static_cast<long long>(key));
  }
}

template <typename I>
__global__ void __launch_bounds__(kThreads)
    mrope_count_kernel(MRopeScan* tiles, MRopeScan* seg_part, int64_t* deltas, int64_t* status,
                       unsigned long long* done, const I* __restrict__ ids, int64_t total, int64_t ntiles,
                       MRopeTables tb) {
  const int64_t gid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  for (int64_t s = gid; s < tb.nseg; s += int64_t(gridDim.x) * blockDim.x)
    deltas[s] = tb.cu[s + 1] > tb.cu[s] ? INT64_MIN : 0;
  if (gid == 0) *status = kMRopeOk;

  const int lane = threadIdx.x & 31;
  const int64_t w = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32;
  if (w < ntiles) {  // warp-uniform
    const int64_t t0 = w * kTile;
    int ty[kSteps];
    load_types(ty, ids, t0, lane, total, tb);
    TileWalk wk;
    wk.prev_last = type_at(ids, t0 - 1, total, tb);
    wk.cur.at(tb, t0);
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      const int64_t b = t0 + k * 32;
      if (b >= total) break;  // warp-uniform
      const TileWalk::Step st = wk.begin(ty[k], b, lane, total, tb);
      // runs started in the tile before each segment start (the nonempty segment whose first token is t)
      if (st.t < total && st.t == st.my.a) {
        const unsigned below = lanes_below(lane);
        const int64_t ci = wk.n_img + __popc(st.bi & below), cv = wk.n_vid + __popc(st.bv & below);
        seg_part[st.my.seg] = MRopeScan{ci | (cv << 32), -1};
      }
      wk.finish(st, ty[k]);
    }
    if (lane == 0) tiles[w] = MRopeScan{wk.n_img | (wk.n_vid << 32), wk.latest};
  }

  // The last block to get here scans the tiles: every other block's writes are fenced before its arrival.
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done, 1ull) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;  // block-uniform
  __threadfence();
  scan_tiles(tiles, ntiles, seg_part, status, total, tb);
}

template <typename I>
__global__ void __launch_bounds__(kThreads)
    mrope_positions_kernel(int64_t* __restrict__ pos, int64_t* __restrict__ text_pos, int64_t* deltas, int64_t* status,
                           const MRopeScan* __restrict__ tiles, const MRopeScan* __restrict__ seg_base,
                           const I* __restrict__ ids, int64_t total, int64_t ntiles, MRopeTables tb) {
  const int lane = threadIdx.x & 31;
  const int64_t w = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32;
  if (w >= ntiles) return;  // warp-uniform
  const int64_t t0 = w * kTile;
  int ty[kSteps];
  load_types(ty, ids, t0, lane, total, tb);
  const int after_tile = type_at(ids, t0 + kTile, total, tb);
  const MRopeScan prefix = tiles[w];
  TileWalk wk;
  wk.n_img = scan_count(prefix, 0);
  wk.n_vid = scan_count(prefix, 1);
  wk.latest = prefix.start;
  wk.prev_last = type_at(ids, t0 - 1, total, tb);
  wk.cur.at(tb, t0);
  int64_t cur_e0 = excess_before(seg_base[wk.cur.seg], tb);
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int64_t b = t0 + k * 32;
    if (b >= total) break;  // warp-uniform
    const TileWalk::Step st = wk.begin(ty[k], b, lane, total, tb);
    const int64_t t = st.t;
    const SegCursor& my = st.my;
    int64_t e0 = cur_e0;
    if (st.moved && t < total) e0 = excess_before(seg_base[my.seg], tb);
    int next = __shfl_down_sync(kAll, ty[k], 1);
    if (k + 1 < kSteps) {
      const int first_next = __shfl_sync(kAll, ty[k + 1 < kSteps ? k + 1 : k], 0);
      if (lane == 31) next = first_next;
    } else if (lane == 31) {
      next = after_tile;
    }
    if (t < total) {
      const unsigned upto = lanes_upto(lane);
      const int64_t ci = wk.n_img + __popc(st.bi & upto), cv = wk.n_vid + __popc(st.bv & upto);
      const unsigned started = (st.bi | st.bv) & upto;
      const MRopeScan sv{ci | (cv << 32), started ? last_lane_token(b, started) : wk.latest};
      int64_t p[3];
      mrope_positions(p, ty[k], t, my.a, sv, e0, tb);
      pos[t] = p[0];
      pos[total + t] = p[1];
      pos[2 * total + t] = p[2];
      text_pos[t] = t - my.a;
      if (t + 1 == my.end || next != ty[k]) {  // last token of its run
        atomicMax(reinterpret_cast<long long*>(deltas + my.seg), static_cast<long long>(mrope_delta(p, my.end - my.a)));
        if (ty[k] != 0) {
          const int m = ty[k] - 1;
          const int64_t key = mrope_check_run(m, sv.start, t + 1, scan_count(sv, m) - 1, my.end, total, next, tb);
          if (key != kMRopeOk) atomicMin(reinterpret_cast<long long*>(status), static_cast<long long>(key));
        }
      }
    }
    wk.finish(st, ty[k]);
    if (st.moved) cur_e0 = __shfl_sync(kAll, e0, 31);
  }
}

template <typename I>
void launch(int64_t* pos, int64_t* text_pos, int64_t* deltas, int64_t* status, void* workspace,
            unsigned long long* done, const I* ids, int64_t total, const MRopeTables& tb, cudaStream_t stream) {
  const int64_t ntiles = num_tiles(total);
  auto* tiles = static_cast<MRopeScan*>(workspace);
  MRopeScan* segs = tiles + ntiles;
  const int64_t tile_blocks = (ntiles + kWarps - 1) / kWarps;
  mrope_count_kernel<I><<<static_cast<int>(tile_blocks > 0 ? tile_blocks : 1), kThreads, 0, stream>>>(
      tiles, segs, deltas, status, done, ids, total, ntiles, tb);
  PC_CUDA_LAUNCH_CHECK();
  if (total == 0) return;
  mrope_positions_kernel<I><<<static_cast<int>(tile_blocks), kThreads, 0, stream>>>(
      pos, text_pos, deltas, status, tiles, segs, ids, total, ntiles, tb);
  PC_CUDA_LAUNCH_CHECK();
}

}  // namespace

size_t mrope_pos_cuda_workspace(int64_t total, int64_t nseg) {
  return static_cast<size_t>(num_tiles(total) + nseg) * sizeof(MRopeScan);
}

void mrope_pos_cuda(int64_t* pos, int64_t* text_pos, int64_t* deltas, int64_t* status, void* workspace,
                    size_t workspace_bytes, int64_t* counter, const void* ids, int id_elem_size, int64_t total,
                    const MRopeTables& tb, cudaStream_t stream) {
  if (workspace_bytes < mrope_pos_cuda_workspace(total, tb.nseg))
    throw std::invalid_argument("packcuda.mrope_pos_cuda: workspace too small");
  auto* done = reinterpret_cast<unsigned long long*>(counter);
  if (id_elem_size == 4)
    launch(pos, text_pos, deltas, status, workspace, done, static_cast<const int32_t*>(ids), total, tb, stream);
  else launch(pos, text_pos, deltas, status, workspace, done, static_cast<const int64_t*>(ids), total, tb, stream);
}

}  // namespace packcuda::rope
