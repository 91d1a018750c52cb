// What this build of the core carries, and the refusal of a CUDA device it has no code for (torch-free; not
// installed).
#pragma once
#include <string>

namespace packcuda {

// The CUDA architectures the build compiled, in TORCH_CUDA_ARCH_LIST form ("8.0;8.6;8.9;9.0+PTX"); "" in a
// CPU-only build.
const char* cuda_arch_list();

// A CUDA device that cannot run the library's kernels.
struct DeviceRefusal {
  int device;             // CUDA device index
  std::string name;       // e.g. "NVIDIA GeForce RTX 2080 Ti"
  int major, minor;       // its compute capability
  std::string error;      // the CUDA runtime's error name, e.g. "cudaErrorNoKernelImageForDevice"
  std::string arch_list;  // the build's TORCH_CUDA_ARCH_LIST (cuda_arch_list())
};
// What went wrong and the command that rebuilds the library for that device.
std::string device_refusal_message(const DeviceRefusal& r);

// Throws std::runtime_error(device_refusal_message(...)) unless the library holds code that `device` runs:
// machine code for its architecture, or PTX the driver compiles for it. Checked on the first call for a device,
// then one atomic load. CUDA builds only (common/cuda/kernel_image.cu).
void require_kernel_image(int device);

}  // namespace packcuda
