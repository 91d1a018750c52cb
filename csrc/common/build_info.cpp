// The build's CUDA architectures (PACKCUDA_CUDA_ARCH_LIST, from the header CMakeLists.txt generates for this
// file) and the message that refuses a device without code in the build.
#include "common/build_info.h"

#include <sstream>

#ifdef PACKCUDA_BUILD_CONFIG
#include "packcuda_build_config.h"
#endif
#ifndef PACKCUDA_CUDA_ARCH_LIST
#define PACKCUDA_CUDA_ARCH_LIST ""
#endif

namespace packcuda {

const char* cuda_arch_list() { return PACKCUDA_CUDA_ARCH_LIST; }

std::string device_refusal_message(const DeviceRefusal& r) {
  std::ostringstream os;
  const std::string arch = std::to_string(r.major) + "." + std::to_string(r.minor);
  os << "packcuda: CUDA device " << r.device << " (" << r.name << ", compute capability " << arch << ") ";
  if (r.error == "cudaErrorNoKernelImageForDevice" || r.error == "cudaErrorInvalidDeviceFunction") {
    os << "cannot run this build of packcuda: it holds CUDA code for TORCH_CUDA_ARCH_LIST=\"" << r.arch_list
       << "\" only (" << r.error << "). Rebuild it for this GPU: ";
  } else if (r.error == "cudaErrorUnsupportedPtxVersion") {
    os << "has no machine code in this build of packcuda (TORCH_CUDA_ARCH_LIST=\"" << r.arch_list
       << "\"), and the driver cannot compile the build's PTX, which comes from a newer CUDA than the driver "
          "supports ("
       << r.error << "). Update the NVIDIA driver, or rebuild packcuda for this GPU: ";
  } else {
    os << "cannot load the kernels of this build of packcuda (TORCH_CUDA_ARCH_LIST=\"" << r.arch_list
       << "\"): " << r.error << ". Rebuild it for this GPU: ";
  }
  os << "TORCH_CUDA_ARCH_LIST=\"" << arch << "\" pip install --force-reinstall --no-deps --no-binary packcuda packcuda"
     << " (from a source checkout: TORCH_CUDA_ARCH_LIST=\"" << arch << "\" pip install .).";
  return os.str();
}

}  // namespace packcuda
