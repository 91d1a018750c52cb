// packcuda core: mRoPE (Qwen-VL 3D) position ids over a packed multimodal stream, on raw pointers (no torch).
// CPU functions run on the calling thread; CUDA functions enqueue on `stream` and never synchronize.
//
// A vision block is a maximal run of image (or video) tokens inside one segment. The host knows every block's
// grid (image_grid_thw / video_grid_thw rows, in stream order per modality) and describes it in a block table
// (see mrope_pos_math.h: MRopeTables). The run structure of input_ids is device data: the kernels find the runs,
// count them with one prefix scan, check each run against its block and write
//   pos [3, T] (t, h, w rows), text_pos [T] (offset in the segment), deltas [nseg] (max position + 1 - length)
// and an error key (kMRopeOk when the runs match the blocks; otherwise the smallest key of all errors, see
// mrope_error_key).
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/stream.h"
#include "rope/mrope_pos_math.h"

namespace packcuda::rope {

// CPU: validates first; returns the error key (kMRopeOk or the earliest error) and writes the outputs only
// when there is no error. `scratch` holds `total` MRopeScan entries.
int64_t mrope_pos_cpu(int64_t* pos, int64_t* text_pos, int64_t* deltas, MRopeScan* scratch, const void* ids,
                      int id_elem_size, int64_t total, const MRopeTables& tb);

// CUDA: bytes of workspace mrope_pos_cuda needs for `total` tokens.
size_t mrope_pos_cuda_workspace(int64_t total);
// CUDA: writes the outputs and status[0] (the error key) without synchronizing. With an error the outputs
// hold unspecified (but in-range) values.
void mrope_pos_cuda(int64_t* pos, int64_t* text_pos, int64_t* deltas, int64_t* status, void* workspace,
                    size_t workspace_bytes, const void* ids, int id_elem_size, int64_t total, const MRopeTables& tb,
                    cudaStream_t stream);

}  // namespace packcuda::rope
