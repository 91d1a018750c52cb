// The CUDA devices this process can use (torch-free), for the torch layer's device checks.
#pragma once

namespace packcuda {

// Number of usable CUDA devices: 0 in a CPU-only build, without a GPU or driver, or with a driver older than the
// CUDA runtime packcuda was built against. Queried once per process.
int cuda_device_count();

}  // namespace packcuda
