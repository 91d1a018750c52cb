#include "common/torch/checks.h"

#include <cstring>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <sstream>

namespace packcuda::th {

const char* dtype_name(ST t) {
  switch (t) {
    case ST::Byte: return "uint8";
    case ST::Char: return "int8";
    case ST::Short: return "int16";
    case ST::Int: return "int32";
    case ST::Long: return "int64";
    case ST::Half: return "float16";
    case ST::Float: return "float32";
    case ST::Double: return "float64";
    case ST::Bool: return "bool";
    case ST::BFloat16: return "bfloat16";
    default: return "unsupported dtype";
  }
}

int64_t element_size(ST t) {
  switch (t) {
    case ST::Byte: case ST::Char: case ST::Bool: return 1;
    case ST::Short: case ST::Half: case ST::BFloat16: return 2;
    case ST::Int: case ST::Float: return 4;
    case ST::Long: case ST::Double: return 8;
    default: return 0;
  }
}

std::string shape_str(const Tensor& t) {
  std::ostringstream os;
  os << "[";
  for (int64_t i = 0; i < t.dim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << "]";
  return os.str();
}

std::string device_str(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  if (t.is_cuda()) return "cuda:" + std::to_string(t.get_device_index());
  return "other";
}

void check_dtype(const char* op, const char* name, const Tensor& t, std::initializer_list<ST> allowed) {
  for (ST a : allowed)
    if (t.scalar_type() == a) return;
  std::string list;
  for (ST a : allowed) list += std::string(list.empty() ? "" : ", ") + dtype_name(a);
  PC_ARG(false, op, name, " must have dtype in {", list, "}, got ", dtype_name(t.scalar_type()));
}

void check_dim(const char* op, const char* name, const Tensor& t, int64_t dim) {
  PC_ARG(t.dim() == dim, op, name, " must be ", dim, "-D, got shape ", shape_str(t));
}

void check_same_device(const char* op, const char* name, const Tensor& t, const char* ref_name,
                       const Tensor& ref) {
  bool same = t.is_cpu() == ref.is_cpu() && t.is_cuda() == ref.is_cuda() &&
              (!t.is_cuda() || t.get_device_index() == ref.get_device_index());
  PC_ARG(same, op, name, " is on ", device_str(t), " but ", ref_name, " is on ", device_str(ref));
}

void check_contiguous(const char* op, const char* name, const Tensor& t) {
  PC_ARG(t.is_contiguous(), op, name, " must be contiguous");
}

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
  if (pinned) {
    TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided_pinned(nd, sizes.data(), strides.data(), dt, dev, idx, &h));
  } else {
    TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(nd, sizes.data(), strides.data(), dt, dev, idx, &h));
  }
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

std::vector<int64_t> host_ints(const Tensor& t) {
  // Tensor accessors cross the stable ABI: read numel, stride and pointer once.
  const int64_t n = t.numel();
  std::vector<int64_t> host(n);
  const int64_t stride = t.stride(0);
  if (t.scalar_type() == ST::Int) {
    const int32_t* p = t.const_data_ptr<int32_t>();
    for (int64_t i = 0; i < n; ++i) host[i] = p[i * stride];
  } else {
    const int64_t* p = t.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) host[i] = p[i * stride];
  }
  return host;
}

std::vector<int64_t> read_host_segments(const char* op, const char* name, const Tensor& cu, int64_t expected_total) {
  std::vector<int64_t> host = host_ints(cu);
  const int64_t n = static_cast<int64_t>(host.size());
  PC_ARG(host[0] == 0, op, name, "[0] must be 0, got ", host[0]);
  for (int64_t i = 1; i < n; ++i)
    PC_ARG(host[i] >= host[i - 1], op, name, " must be non-decreasing, but ", name, "[", i, "]=", host[i], " < ",
           name, "[", i - 1, "]=", host[i - 1]);
  if (expected_total >= 0)
    PC_ARG(host.back() == expected_total, op, name, "[-1]=", host.back(), " does not match the number of tokens (",
           expected_total, ")");
  return host;
}

Segments segments(const char* op, const char* name, const Tensor& cu, const torch::stable::Device& target,
                  int64_t expected_total, bool upload) {
  check_dim(op, name, cu, 1);
  check_dtype(op, name, cu, {ST::Int, ST::Long});
  PC_ARG(cu.numel() >= 1, op, name, " must have at least one entry (it starts with 0)");
  Segments s;
  s.count = cu.numel() - 1;
  if (cu.is_cpu()) {
    s.on_host = true;
    s.host = read_host_segments(op, name, cu, expected_total);
    if (upload) s.tensor = upload_i64(s.host, target);
  } else {
    PC_ARG(cu.is_cuda() && target.type() == torch::headeronly::DeviceType::CUDA &&
               cu.get_device_index() == target.index(),
           op, name, " is on ", device_str(cu), " but the data is on another device");
    Tensor t = cu;
    if (t.scalar_type() != ST::Long) t = torch::stable::to(t, ST::Long);
    if (!t.is_contiguous()) t = torch::stable::contiguous(t);
    s.tensor = t;
  }
  return s;
}

void check_row_dtype(const char* op, const char* name, const Tensor& t) {
  PC_ARG(element_size(t.scalar_type()) > 0, op, name, " has unsupported dtype ", dtype_name(t.scalar_type()));
}

std::vector<int64_t> shape_of(const Tensor& t) {
  std::vector<int64_t> s(t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) s[i] = t.size(i);
  return s;
}

int64_t row_bytes_of(const Tensor& t) {
  int64_t n = element_size(t.scalar_type());
  for (int64_t i = 1; i < t.dim(); ++i) n *= t.size(i);
  return n;
}

uint64_t fill_bits(ST t, double value) {
  uint64_t bits = 0;
  auto put = [&](auto v) { std::memcpy(&bits, &v, sizeof(v)); };
  switch (t) {
    case ST::Bool: put(static_cast<uint8_t>(value != 0)); break;
    case ST::Byte: put(static_cast<uint8_t>(value)); break;
    case ST::Char: put(static_cast<int8_t>(value)); break;
    case ST::Short: put(static_cast<int16_t>(value)); break;
    case ST::Int: put(static_cast<int32_t>(value)); break;
    case ST::Long: put(static_cast<int64_t>(value)); break;
    case ST::Half: put(c10::Half(static_cast<float>(value))); break;
    case ST::BFloat16: put(c10::BFloat16(static_cast<float>(value))); break;
    case ST::Float: put(static_cast<float>(value)); break;
    case ST::Double: put(value); break;
    default: break;
  }
  return bits;
}

void check_index_range(const char* op, const char* name, const Tensor& index, int64_t lo, int64_t hi,
                       bool unique) {
  const int64_t* p = index.const_data_ptr<int64_t>();
  const int64_t n = index.numel();
  std::vector<uint8_t> seen(unique && hi > 0 ? hi : 0, 0);
  for (int64_t i = 0; i < n; ++i) {
    PC_ARG(p[i] >= lo && p[i] < hi, op, name, "[", i, "]=", p[i], " is out of range [", lo, ", ", hi, ")");
    if (unique && p[i] >= 0) {
      PC_ARG(!seen[p[i]], op, name, " must not repeat a row, but ", p[i], " appears twice");
      seen[p[i]] = 1;
    }
  }
}

torch::stable::Device target_device(const Tensor& meta, const std::optional<torch::stable::Device>& device) {
  if (device.has_value()) return *device;
  return meta.device();
}

cudaStream_t current_stream(int32_t device_index) {
#ifdef USE_CUDA
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return reinterpret_cast<cudaStream_t>(stream);
#else
  (void)device_index;
  throw std::runtime_error("packcuda was built without CUDA");
#endif
}

}  // namespace packcuda::th
