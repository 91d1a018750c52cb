// Torch layer tensor helpers (stable ABI only): allocation straight through the C shim, contiguous views,
// copies and uploads of host metadata, the current CUDA stream and a device scope. Included by checks.h.
#pragma once
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common/stream.h"

namespace packcuda::th {

using torch::stable::Tensor;
using ST = torch::headeronly::ScalarType;

// Copy of host int64 values onto a device (non-blocking, no sync).
Tensor upload_i64(const std::vector<int64_t>& values, const torch::stable::Device& target);

// An allocation that torch's allocator refused (out of memory, or more than any allocator can give): a
// std::runtime_error (a RuntimeError in Python, like torch's own allocation failures; torch.OutOfMemoryError
// cannot cross the stable ABI) saying what was asked for - dtype, shape, bytes, device. The op registration
// (PC_IMPL, checks.h) puts the op's name in front.
struct AllocError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A new uninitialized contiguous tensor, straight through the C shim (no operator lookup by name: these sit
// on per-call host paths). pinned: page-locked host memory from torch's caching host allocator (CPU only).
// Throws AllocError when the allocator refuses.
Tensor new_tensor(const std::vector<int64_t>& sizes, ST dtype, const torch::stable::Device& device,
                  bool pinned = false);
// `t` itself when it is already contiguous (one cheap query), else a contiguous copy.
Tensor dense(const Tensor& t);
// new_tensor on `like`'s device with `like`'s dtype (or `dtype`).
Tensor new_like(const Tensor& like, const std::vector<int64_t>& sizes);
Tensor new_like(const Tensor& like, const std::vector<int64_t>& sizes, ST dtype);
// dst.copy_(src); with non_blocking and a pinned host source the copy is queued on the current stream and the
// host allocator keeps the source alive until it has run.
void copy_into(Tensor& dst, const Tensor& src, bool non_blocking);

// Current CUDA stream of a device (only valid in CUDA builds). Every kernel launch gets its stream here, so this
// is where a device the build has no code for is refused, with the command that rebuilds for it
// (require_kernel_image, common/build_info.h).
cudaStream_t current_stream(int32_t device_index);

// Device guard + current stream of a tensor's CUDA device.
struct CudaScope {
  torch::stable::accelerator::DeviceGuard guard;
  cudaStream_t stream;
  explicit CudaScope(const Tensor& t) : guard(t.get_device_index()), stream(current_stream(t.get_device_index())) {}
};

// The one device split of the torch layer: runs an op's kernel on the device of `t` - cpu() on the host, or
// cuda(stream) under a device guard on the current stream of t's CUDA device. The kernel device is that of a
// tensor, not the dispatch key: ops whose output device comes from a device argument (host metadata in, CUDA
// tables out) are registered for CPU and CUDA and pick the kernel here. `cuda` is a generic lambda
// ([&](auto stream) {...}) so that a CPU-only build never instantiates it and never links a CUDA kernel; such a
// build refuses a CUDA tensor (std::runtime_error, as the dispatcher refuses one without a CUDA kernel).
template <class Cpu, class Cuda>
void run_kernel(const Tensor& t, Cpu&& cpu, Cuda&& cuda) {
  if (!t.is_cuda()) {
    cpu();
    return;
  }
#ifdef USE_CUDA
  CudaScope cs(t);
  cuda(cs.stream);
#else
  (void)cuda;
  throw std::runtime_error("packcuda was built without CUDA kernels");
#endif
}

}  // namespace packcuda::th
