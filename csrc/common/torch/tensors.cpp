#include "common/torch/tensors.h"
#include "common/build_info.h"  // require_kernel_image

#include <cstring>

#include "common/torch/checks.h"

namespace packcuda::th {

namespace {
// "<n> bytes (<n / 2^k> <unit>)"; sizes whose byte count overflows int64 say so.
std::string bytes_str(const std::vector<int64_t>& sizes, ST dtype) {
  int64_t n = element_size(dtype);
  for (int64_t s : sizes)
    if (__builtin_mul_overflow(n, s, &n)) return "more than 2^63 bytes";
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(n);
  int u = 0;
  for (; v >= 1024.0 && u < 6; ++u) v /= 1024.0;
  if (u == 0) return detail::cat(n, " bytes");
  return detail::cat(n, " bytes (", static_cast<double>(static_cast<int64_t>(v * 10)) / 10, " ", units[u], ")");
}
}  // namespace

Tensor new_tensor(const std::vector<int64_t>& sizes, ST dtype, const torch::stable::Device& device, bool pinned) {
  const int64_t nd = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> strides(nd);
  int64_t st = 1;
  for (int64_t i = nd - 1; i >= 0; --i) {
    strides[i] = st;
    st *= sizes[i] > 1 ? sizes[i] : 1;
  }
  AtenTensorHandle h = nullptr;
  const int32_t dt = static_cast<int32_t>(dtype);
  const int32_t dev = static_cast<int32_t>(device.type());
  const int32_t idx = device.index();
  const AOTITorchError err = pinned
                                 ? aoti_torch_empty_strided_pinned(nd, sizes.data(), strides.data(), dt, dev, idx, &h)
                                 : aoti_torch_empty_strided(nd, sizes.data(), strides.data(), dt, dev, idx, &h);
  if (err != AOTI_TORCH_SUCCESS)
    throw AllocError(detail::cat("could not allocate ", bytes_str(sizes, dtype), " for a ", dtype_name(dtype),
                                 " tensor of shape ", list_str(sizes), " on ",
                                 pinned ? std::string("pinned host memory") : device_str(device), " (out of memory)"));
  return Tensor(h);
}

Tensor dense(const Tensor& t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

Tensor new_like(const Tensor& like, const std::vector<int64_t>& sizes) {
  return new_tensor(sizes, like.scalar_type(), like.device());
}
Tensor new_like(const Tensor& like, const std::vector<int64_t>& sizes, ST dtype) {
  return new_tensor(sizes, dtype, like.device());
}

void copy_into(Tensor& dst, const Tensor& src, bool non_blocking) {
  TORCH_ERROR_CODE_CHECK(aoti_torch_copy_(dst.get(), src.get(), non_blocking ? 1 : 0));
}

Tensor upload_i64(const std::vector<int64_t>& values, const torch::stable::Device& target) {
  const std::vector<int64_t> sizes{static_cast<int64_t>(values.size())};
  const bool to_cpu = target.type() == torch::headeronly::DeviceType::CPU;
  // For a device target the staging buffer is pinned (torch's caching host allocator keeps it alive until
  // the copy has run), so the copy is truly asynchronous: the host never waits for the device. A pageable
  // source would make the driver stage it synchronously behind the work already queued on the stream.
  Tensor host = new_tensor(sizes, ST::Long, torch::stable::Device(torch::headeronly::DeviceType::CPU), !to_cpu);
  if (!values.empty()) std::memcpy(host.mutable_data_ptr(), values.data(), values.size() * sizeof(int64_t));
  if (to_cpu) return host;
  Tensor dev = new_tensor(sizes, ST::Long, target);
  copy_into(dev, host, /*non_blocking=*/true);
  return dev;
}

cudaStream_t current_stream(int32_t device_index) {
#ifdef USE_CUDA
  require_kernel_image(device_index);
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return reinterpret_cast<cudaStream_t>(stream);
#else
  (void)device_index;
  throw std::runtime_error("packcuda was built without CUDA");
#endif
}

}  // namespace packcuda::th
