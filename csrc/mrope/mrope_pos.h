// packcuda core: mRoPE (Qwen-VL 3D) position ids over a packed multimodal stream, on raw pointers (no torch).
// CPU functions run on the calling thread; CUDA functions enqueue on `stream` and never synchronize.
//
// A vision block is a maximal run of image (or video) tokens inside one segment. The host knows every block's
// grid (image_grid_thw / video_grid_thw rows, in stream order per modality) and describes it in a block table
// (see mrope_pos_math.h: MRopeTables). The run structure of input_ids is device data: the kernels find the runs,
// count them with a prefix scan, check each run against its block and write
//   pos [3, T] (t, h, w rows), text_pos [T] (offset in the segment), deltas [nseg] (max position + 1 - length)
// and an error key (kMRopeOk when the runs match the blocks; otherwise the smallest key of all errors, see
// mrope_error_key).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../common/stream.h"
#include "mrope_pos_math.h"

namespace packcuda::rope {

// One image or video grid row [t, h, w] (patches before the spatial merge).
struct MRopeGrid {
  int64_t t, h, w;
};

// Layout of the host block table of a packed stream: `head` leading entries (e.g. the host cu_seqlens, so one
// upload carries both), the rows of every image block then every video block (kBlockCols columns each, see
// mrope_pos_math.h), then per modality the prefix sums of (length - advance) (n + 1 entries each).
struct MRopeTableLayout {
  int64_t head = 0;
  int64_t n[2] = {0, 0};  // image blocks, video blocks
  int64_t offset_blocks(int m) const { return head + (m == 0 ? 0 : n[0] * kBlockCols); }
  int64_t offset_px(int m) const { return head + (n[0] + n[1]) * kBlockCols + (m == 0 ? 0 : n[0] + 1); }
  int64_t size() const { return offset_px(1) + n[1] + 1; }
  // The kernels' view of a table with this layout that starts at `base` (host or device memory).
  MRopeTables tables(const int64_t* base, const int64_t* cu, int64_t nseg, int64_t image_token_id,
                     int64_t video_token_id) const {
    MRopeTables tb;
    tb.cu = cu;
    tb.nseg = nseg;
    for (int m = 0; m < 2; ++m) {
      tb.blocks[m] = base + offset_blocks(m);
      tb.px[m] = base + offset_px(m);
      tb.nblocks[m] = n[m];
    }
    tb.token_id[0] = image_token_id;
    tb.token_id[1] = video_token_id;
    return tb;
  }
};

// Division of non-negative values by the spatial merge size: a shift when it is a power of two (it is 2 in every
// Qwen-VL model; the host divides every grid row several times, and a 64-bit division costs tens of cycles).
struct MergeDiv {
  int64_t d = 1;
  int shift = 0;  // -1: not a power of two
  explicit MergeDiv(int64_t merge) : d(merge) {
    shift = -1;
    for (int s = 0; s < 62; ++s)
      if ((int64_t(1) << s) == merge) shift = s;
  }
  int64_t div(int64_t x) const { return shift >= 0 ? x >> shift : x / d; }
  bool divides(int64_t x) const { return shift >= 0 ? (x & (d - 1)) == 0 : x % d == 0; }
};

// Temporal interval of whole video v: float32(tokens_per_second) * float32(secs[v]) (1.0 without secs), one
// float32 multiply as transformers computes it (Qwen2.5-VL); 1 without tokens_per_second.
inline float mrope_video_interval(const double* tokens_per_second, const float* secs, int64_t v) {
  return tokens_per_second ? static_cast<float>(*tokens_per_second) * (secs ? secs[v] : 1.0f) : 1.0f;
}

// The layout for n_images image rows and the video rows (per_frame: a video row [t, h, w] is t blocks).
MRopeTableLayout mrope_table_layout(int64_t head, int64_t n_images, const MRopeGrid* videos, int64_t n_videos,
                                    bool per_frame);

// Writes entries [L.head, L.size()) of the block table (the head is the caller's) from valid grids (t, h, w >= 1;
// h and w divisible by `merge`) into out[0, L.size()). `secs` (one per video row) and `tokens_per_second` may be
// null. Qwen2.5-VL video interval: float32(tokens_per_second) * float32(secs[v]) (1.0 without secs).
void fill_mrope_block_table(int64_t* out, const MRopeTableLayout& L, const MRopeGrid* images, const MRopeGrid* videos,
                            int64_t n_videos, const float* secs, int64_t merge, const double* tokens_per_second,
                            bool per_frame, bool text_after_max);

// The block table in a vector (head first), plus which grid row (`row`) and video frame (`frame`, -1 for whole
// blocks) each block comes from, for messages naming a block.
struct MRopeBlockTable : MRopeTableLayout {
  std::vector<int64_t> table;
  std::vector<int64_t> row[2], frame[2];
};

MRopeBlockTable build_mrope_block_table(std::vector<int64_t> head, const MRopeGrid* images, int64_t n_images,
                                        const MRopeGrid* videos, int64_t n_videos, const float* secs, int64_t merge,
                                        const double* tokens_per_second, bool per_frame, bool text_after_max);

// CPU: validates first; returns the error key (kMRopeOk or the earliest error) and writes the outputs only
// when there is no error. Two sequential passes over the tokens, no scratch memory.
int64_t mrope_pos_cpu(int64_t* pos, int64_t* text_pos, int64_t* deltas, const void* ids, int id_elem_size,
                      int64_t total, const MRopeTables& tb);

// CUDA: bytes of device workspace mrope_pos_cuda needs for `total` tokens in `nseg` segments (16 bytes per tile of
// 256 tokens and per segment; no per-token scratch).
size_t mrope_pos_cuda_workspace(int64_t total, int64_t nseg);
// CUDA: writes the outputs and status[0] (the error key) without synchronizing. With an error the outputs
// hold unspecified (but in-range) values. Two kernels (see mrope_pos_cuda.cu). `counter` is a device int64 that
// holds 0 when the kernels start (e.g. an extra entry of the uploaded block table, so it costs no memset); the
// kernels use it to find the last block of the first kernel and leave it nonzero.
void mrope_pos_cuda(int64_t* pos, int64_t* text_pos, int64_t* deltas, int64_t* status, void* workspace,
                    size_t workspace_bytes, int64_t* counter, const void* ids, int id_elem_size, int64_t total,
                    const MRopeTables& tb, cudaStream_t stream);

}  // namespace packcuda::rope
