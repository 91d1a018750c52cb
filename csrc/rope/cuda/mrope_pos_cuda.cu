// mRoPE position ids on the GPU: one flag kernel (run starts, output init), one cub scan of (runs per modality,
// latest run start), one kernel over tokens (positions, run checks, per-segment maxima). Three steps whatever
// the number of blocks; no host synchronization.
#include <cub/device/device_scan.cuh>

#include "common/cuda_utils.cuh"
#include "rope/mrope_pos.h"
#include "rope/mrope_pos_math.h"

namespace packcuda::rope {
namespace {

constexpr int kThreads = 256;

template <typename I>
__global__ void __launch_bounds__(kThreads)
    mrope_flags_kernel(MRopeScan* scan, int64_t* deltas, int64_t* status, const I* ids, int64_t total,
                       MRopeTables tb) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t i0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  for (int64_t t = i0; t < total; t += stride) scan[t] = mrope_scan_input(ids, t, tb);
  for (int64_t s = i0; s < tb.nseg; s += stride) deltas[s] = tb.cu[s + 1] > tb.cu[s] ? INT64_MIN : 0;
  if (i0 == 0) *status = kMRopeOk;
}

template <typename I>
__global__ void __launch_bounds__(kThreads)
    mrope_positions_kernel(int64_t* __restrict__ pos, int64_t* __restrict__ text_pos, int64_t* deltas,
                           int64_t* status, const MRopeScan* __restrict__ scan, const I* __restrict__ ids,
                           int64_t total, MRopeTables tb) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += stride) {
    const MRopeToken o = mrope_token(ids, scan, tb, t, total);
    pos[t] = o.p[0];
    pos[total + t] = o.p[1];
    pos[2 * total + t] = o.p[2];
    text_pos[t] = o.local;
    // Integer max: the result does not depend on the order of the updates.
    if (o.run_end)
      atomicMax(reinterpret_cast<long long*>(deltas + o.seg),
                static_cast<long long>(max3(o.p[0], o.p[1], o.p[2]) + 1 - o.seg_len));
    if (scan[t].start == t) {
      const int64_t key = mrope_check_start(ids, scan, tb, t, total);
      if (key != kMRopeOk) atomicMin(reinterpret_cast<long long*>(status), static_cast<long long>(key));
    }
    if (t == total - 1) {
      const int64_t key = mrope_check_counts(scan[t], tb, total);
      if (key != kMRopeOk) atomicMin(reinterpret_cast<long long*>(status), static_cast<long long>(key));
    }
  }
}

size_t cub_bytes(int64_t total) {
  size_t bytes = 0;
  PC_CUDA_CHECK(cub::DeviceScan::InclusiveScan(nullptr, bytes, static_cast<MRopeScan*>(nullptr),
                                               static_cast<MRopeScan*>(nullptr), MRopeScanOp{}, total));
  return bytes;
}

size_t scan_bytes(int64_t total) { return (static_cast<size_t>(total) * sizeof(MRopeScan) + 255) & ~size_t(255); }

template <typename I>
void launch(int64_t* pos, int64_t* text_pos, int64_t* deltas, int64_t* status, void* workspace, size_t ws_bytes,
            const I* ids, int64_t total, const MRopeTables& tb, cudaStream_t stream) {
  auto* scan = static_cast<MRopeScan*>(workspace);
  const int64_t n = total > tb.nseg ? total : tb.nseg;
  mrope_flags_kernel<I><<<cuda::grid_for(n, kThreads), kThreads, 0, stream>>>(scan, deltas, status, ids, total, tb);
  PC_CUDA_LAUNCH_CHECK();
  if (total == 0) return;
  size_t tmp_bytes = ws_bytes - scan_bytes(total);
  void* tmp = static_cast<char*>(workspace) + scan_bytes(total);
  PC_CUDA_CHECK(cub::DeviceScan::InclusiveScan(tmp, tmp_bytes, scan, scan, MRopeScanOp{}, total, stream));
  mrope_positions_kernel<I><<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(pos, text_pos, deltas, status,
                                                                                      scan, ids, total, tb);
  PC_CUDA_LAUNCH_CHECK();
}

}  // namespace

size_t mrope_pos_cuda_workspace(int64_t total) { return scan_bytes(total) + cub_bytes(total > 0 ? total : 1); }

void mrope_pos_cuda(int64_t* pos, int64_t* text_pos, int64_t* deltas, int64_t* status, void* workspace,
                    size_t workspace_bytes, const void* ids, int id_elem_size, int64_t total, const MRopeTables& tb,
                    cudaStream_t stream) {
  if (id_elem_size == 4)
    launch(pos, text_pos, deltas, status, workspace, workspace_bytes, static_cast<const int32_t*>(ids), total, tb,
           stream);
  else
    launch(pos, text_pos, deltas, status, workspace, workspace_bytes, static_cast<const int64_t*>(ids), total, tb,
           stream);
}

}  // namespace packcuda::rope
