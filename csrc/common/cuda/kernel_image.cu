// Whether a device can run the library's kernels: the CUDA runtime is asked for the attributes of a kernel
// compiled like every other one (same translation flags, same architectures). That loads the kernel's module
// for the device (compiling its PTX when the build has no machine code for it), and fails with
// cudaErrorNoKernelImageForDevice when neither fits.
#include <atomic>
#include <stdexcept>

#include "common/build_info.h"
#include "common/cuda_utils.cuh"

namespace packcuda {
namespace {

__global__ void probe_kernel() {}

constexpr int kMaxDevices = 64;
std::atomic<bool> device_ok[kMaxDevices];  // zero-initialised: not checked yet

}  // namespace

void require_kernel_image(int device) {
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && device_ok[device].load(std::memory_order_acquire)) return;
  int current = 0;
  PC_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) PC_CUDA_CHECK(cudaSetDevice(device));
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, probe_kernel);
  (void)cudaGetLastError();  // the failure is reported here, not left for the next launch check
  if (current != device) PC_CUDA_CHECK(cudaSetDevice(current));
  if (e == cudaSuccess) {
    if (cached) device_ok[device].store(true, std::memory_order_release);
    return;
  }
  DeviceRefusal r{device, "?", 0, 0, cudaGetErrorName(e), cuda_arch_list()};
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    r.name = prop.name;
    r.major = prop.major;
    r.minor = prop.minor;
  }
  throw std::runtime_error(device_refusal_message(r));
}

}  // namespace packcuda
