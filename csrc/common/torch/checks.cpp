#include "common/torch/checks.h"
#include "common/checked.h"
#include "common/devices.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <sstream>

namespace packcuda::th {

DType core_dtype(ST t) {
  switch (t) {
    case ST::Double: return DType::F64;
    case ST::BFloat16: return DType::BF16;
    case ST::Half: return DType::F16;
    default: return DType::F32;
  }
}

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
    case ST::Byte:
    case ST::Char:
    case ST::Bool: return 1;
    case ST::Short:
    case ST::Half:
    case ST::BFloat16: return 2;
    case ST::Int:
    case ST::Float: return 4;
    case ST::Long:
    case ST::Double: return 8;
    default: return 0;
  }
}

std::string list_str(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

std::string shape_str(const Tensor& t) {
  const auto sz = t.sizes();
  return list_str(std::vector<int64_t>(sz.begin(), sz.end()));
}

std::string device_str(const torch::stable::Device& d) {
  if (d.is_cpu()) return "cpu";
  if (d.is_cuda()) return d.has_index() ? "cuda:" + std::to_string(d.index()) : std::string("cuda");
  if (d.type() == torch::headeronly::DeviceType::Meta) return "meta";
  return detail::cat("device type ", static_cast<int>(d.type()));
}

std::string device_str(const Tensor& t) { return device_str(t.device()); }

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

void check_same_device(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref) {
  bool same = t.is_cpu() == ref.is_cpu() && t.is_cuda() == ref.is_cuda() &&
              (!t.is_cuda() || t.get_device_index() == ref.get_device_index());
  PC_ARG(same, op, name, " is on ", device_str(t), " but ", ref_name, " is on ", device_str(ref));
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
    PC_ARG(host[i] >= host[i - 1], op, name, " must be non-decreasing, but ", name, "[", i, "]=", host[i], " < ", name,
           "[", i - 1, "]=", host[i - 1]);
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
  check_device_kind(op, "device", target);
  Segments s;
  s.count = cu.numel() - 1;
  if (cu.is_cpu()) {
    s.on_host = true;
    s.host = read_host_segments(op, name, cu, expected_total);
    if (upload) s.tensor = upload_i64(s.host, target);
  } else {
    PC_ARG(
        cu.is_cuda() && target.type() == torch::headeronly::DeviceType::CUDA && cu.get_device_index() == target.index(),
        op, name, " is on ", device_str(cu), " but the data is on ", device_str(target));
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

bool int_dtype_range(ST t, int64_t& lo, int64_t& hi) {
  switch (t) {
    case ST::Bool: lo = 0, hi = 1; return true;
    case ST::Byte: lo = 0, hi = 255; return true;
    case ST::Char: lo = -128, hi = 127; return true;
    case ST::Short: lo = -32768, hi = 32767; return true;
    case ST::Int: lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max(); return true;
    case ST::Long: lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max(); return true;
    default: return false;
  }
}

namespace {
// Bits of a floating fill; a finite value that the dtype rounds to infinity is refused.
uint64_t float_fill_bits(const char* op, const char* name, ST t, double value) {
  uint64_t bits = 0;
  auto put = [&](auto v) { std::memcpy(&bits, &v, sizeof(v)); };
  double held = value;
  switch (t) {
    case ST::Half: {
      const c10::Half h(static_cast<float>(value));
      held = static_cast<float>(h);
      put(h);
      break;
    }
    case ST::BFloat16: {
      const c10::BFloat16 h(static_cast<float>(value));
      held = static_cast<float>(h);
      put(h);
      break;
    }
    case ST::Float: {
      const float f = static_cast<float>(value);
      held = f;
      put(f);
      break;
    }
    case ST::Double: put(value); break;
    default: PC_ARG(false, op, name, ": dtype ", dtype_name(t), " is not supported");
  }
  PC_ARG(!std::isfinite(value) || std::isfinite(held), op, name, "=", value, " is beyond the finite range of ",
         dtype_name(t));
  return bits;
}

uint64_t int_fill_bits(ST t, int64_t v) {
  uint64_t bits = 0;
  auto put = [&](auto x) { std::memcpy(&bits, &x, sizeof(x)); };
  switch (t) {
    case ST::Bool:
    case ST::Byte: put(static_cast<uint8_t>(v)); break;
    case ST::Char: put(static_cast<int8_t>(v)); break;
    case ST::Short: put(static_cast<int16_t>(v)); break;
    case ST::Int: put(static_cast<int32_t>(v)); break;
    default: put(v); break;
  }
  return bits;
}
}  // namespace

uint64_t fill_bits(const char* op, const char* name, ST t, double value) {
  int64_t lo, hi;
  if (!int_dtype_range(t, lo, hi)) return float_fill_bits(op, name, t, value);
  // -2^63 and 2^63 are exact doubles: the range test is exact for every double (NaN fails it too)
  const bool in_range = value >= static_cast<double>(lo) &&
                        (t == ST::Long ? value < 9223372036854775808.0 : value <= static_cast<double>(hi));
  PC_ARG(in_range && std::trunc(value) == value, op, name, "=", value, " cannot be held exactly by ", dtype_name(t),
         " (integral values in [", lo, ", ", hi, "] only)");
  return int_fill_bits(t, static_cast<int64_t>(value));
}

uint64_t fill_bits(const char* op, const char* name, ST t, int64_t value) {
  int64_t lo, hi;
  if (!int_dtype_range(t, lo, hi)) return float_fill_bits(op, name, t, static_cast<double>(value));
  PC_ARG(value >= lo && value <= hi, op, name, "=", value, " is out of range for ", dtype_name(t), " [", lo, ", ", hi,
         "]");
  return int_fill_bits(t, value);
}

void check_index_range(const char* op, const char* name, const Tensor& index, int64_t lo, int64_t hi, bool unique) {
  const int64_t* p = index.const_data_ptr<int64_t>();
  const int64_t n = index.numel();
  for (int64_t i = 0; i < n; ++i)
    PC_ARG(p[i] >= lo && p[i] < hi, op, name, "[", i, "]=", p[i], " is out of range [", lo, ", ", hi, ")");
  if (!unique || n < 2) return;
  // A byte per row when the rows are not many more than the index entries, else a sorted copy.
  if (hi <= 16 * n + 4096) {
    std::vector<uint8_t> seen(hi > 0 ? hi : 0, 0);
    for (int64_t i = 0; i < n; ++i) {
      if (p[i] < 0) continue;
      PC_ARG(!seen[p[i]], op, name, " must not repeat a row, but ", p[i], " appears twice");
      seen[p[i]] = 1;
    }
  } else {
    std::vector<int64_t> v;
    v.reserve(n);
    for (int64_t i = 0; i < n; ++i)
      if (p[i] >= 0) v.push_back(p[i]);
    std::sort(v.begin(), v.end());
    const auto d = std::adjacent_find(v.begin(), v.end());
    PC_ARG(d == v.end(), op, name, " must not repeat a row, but ", (d == v.end() ? 0 : *d), " appears twice");
  }
}

int64_t checked_nbytes(const char* op, const char* what, const std::vector<int64_t>& sizes, ST t) {
  int64_t n = element_size(t);
  for (int64_t s : sizes) PC_ARG(s >= 0, op, what, " has a negative size ", s);
  for (int64_t s : sizes)
    if (s == 0) return 0;
  for (int64_t s : sizes) n = checked::mul(op, what, n, s);
  return n;
}

torch::stable::Device target_device(const char* op, const Tensor& meta,
                                    const std::optional<torch::stable::Device>& device) {
  torch::stable::Device d = device.has_value() ? *device : meta.device();
  check_device_kind(op, "device", d);
  if (device.has_value() && d.is_cuda()) {
    // A device argument may name a CUDA device this process cannot use: refused here, before torch's CUDA calls
    // (the current device, pinned staging) would fail on it with a driver error.
#ifdef USE_CUDA
    const int n = cuda_device_count();
    PC_ARG(n > 0 && d.index() < n, op, "device=", device_str(d), " is not available here (CUDA devices: ", n, ")");
#else
    PC_ARG(false, op, "device=", device_str(d), " is not available: packcuda was built without CUDA kernels");
#endif
  }
  if (d.is_cuda() && !d.has_index()) d.set_index(torch::stable::accelerator::getCurrentDeviceIndex());
  return d;
}

void check_device_kind(const char* op, const char* name, const torch::stable::Device& d) {
  PC_ARG(d.is_cpu() || d.is_cuda(), op, name, "=", device_str(d), " is not supported (packcuda runs on cpu and cuda)");
}

}  // namespace packcuda::th
