#include "common/devices.h"

#ifdef PACKCUDA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace packcuda {

int cuda_device_count() {
#ifdef PACKCUDA_WITH_CUDA
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();  // the query's error is not left for a later launch check to report
      n = 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

}  // namespace packcuda
