// Torch layer argument checks (stable ABI only): readable messages naming the op and the argument, dtype names,
// host/device metadata (cu_seqlens) handling, fill values and index ranges. Included only by *_ops.cpp files;
// allocation, copies and streams are in tensors.h (included here).
#pragma once
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/stream.h"
#include "common/torch/tensors.h"

namespace packcuda::th {

using torch::stable::Tensor;
using ST = torch::headeronly::ScalarType;

const char* dtype_name(ST t);
// The core element type of a floating torch dtype (common/dtype.h); other dtypes map to F32 (callers check first).
DType core_dtype(ST t);
std::string list_str(const std::vector<int64_t>& v);  // "[a, b, c]"
std::string shape_str(const Tensor& t);
std::string device_str(const Tensor& t);
std::string device_str(const torch::stable::Device& d);  // "cpu", "cuda:0", "meta", ...

// Throws std::invalid_argument("packcuda.<op>: <message>") when cond is false.
#define PC_ARG(cond, op, ...)                                                                              \
  do {                                                                                                     \
    if (!(cond)) throw std::invalid_argument(::packcuda::detail::cat("packcuda.", op, ": ", __VA_ARGS__)); \
  } while (0)

// Registers `fn` as the kernel of packcuda::<name> (m.impl with TORCH_BOX) behind run_boxed, so that an
// allocation failure inside it names the op: "packcuda.<name>: could not allocate <bytes> for a <dtype> tensor of
// shape <shape> on <device> ...". Every op registers through it.
#define PC_IMPL(m, name, fn)                                                        \
  (m).impl(name, [](StableIValue* stack, uint64_t num_args, uint64_t num_outputs) { \
    ::packcuda::th::run_boxed(name, TORCH_BOX(fn), stack, num_args, num_outputs);   \
  })
void run_boxed(const char* op, void (*boxed)(StableIValue*, uint64_t, uint64_t), StableIValue* stack, uint64_t num_args,
               uint64_t num_outputs);

void check_dtype(const char* op, const char* name, const Tensor& t, std::initializer_list<ST> allowed);
void check_dim(const char* op, const char* name, const Tensor& t, int64_t dim);
void check_same_device(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref);
int64_t element_size(ST t);

// Segment boundaries (cu_seqlens) given either on the host (CPU tensor) or on the data's device.
//  - host: values are validated (first entry 0, non-decreasing, last entry == expected_total when
//    expected_total >= 0) and, for a CUDA target, uploaded with a non-blocking copy (no device sync);
//  - device: dtype/shape are validated; values are trusted (the Python facade validated them on the host).
struct Segments {
  Tensor tensor;               // int64, contiguous, on the target device
  std::vector<int64_t> host;   // the values, when given on the host
  bool on_host = false;
  int64_t count = 0;           // number of segments
  const int64_t* ptr() const { return tensor.const_data_ptr<int64_t>(); }
};
// upload=false leaves `tensor` empty for host metadata (the caller uploads `host` itself, e.g. packed with other
// host data in one copy).
Segments segments(const char* op, const char* name, const Tensor& cu, const torch::stable::Device& target,
                  int64_t expected_total, bool upload = true);
// The validated values of a host cu_seqlens (1-D int32/int64 CPU tensor; dim and dtype checked by the caller).
// Values of a 1-D int32/int64 CPU tensor (any stride) as int64.
std::vector<int64_t> host_ints(const Tensor& t);
std::vector<int64_t> read_host_segments(const char* op, const char* name, const Tensor& cu, int64_t expected_total);

// Row ops move any dtype of 1, 2, 4 or 8 bytes.
void check_row_dtype(const char* op, const char* name, const Tensor& t);
std::vector<int64_t> shape_of(const Tensor& t);
// One element of dtype t holding `value`, as raw bits. A value the dtype cannot hold is refused (naming op and
// name): bool takes 0 or 1; integer dtypes take integral values in their range; floating dtypes take NaN, +-inf
// and any finite value that stays finite in the dtype (it is rounded to the nearest representable value).
uint64_t fill_bits(const char* op, const char* name, ST t, double value);
// The same for an integer value (carried as an integer end to end: no rounding through a double for int64).
uint64_t fill_bits(const char* op, const char* name, ST t, int64_t value);
// Range [lo, hi] of an integer dtype (int8 .. int64, uint8, bool); false for other dtypes.
bool int_dtype_range(ST t, int64_t& lo, int64_t& hi);
// Host check of an int64 index tensor: values in [lo, hi), unique among those >= 0 when asked. Memory use is
// bounded by the index length (a huge hi with a short index does not allocate hi bytes).
void check_index_range(const char* op, const char* name, const Tensor& index, int64_t lo, int64_t hi, bool unique);
// Bytes of a contiguous tensor of `sizes` and dtype t, with checked arithmetic (an overflow is refused naming
// op and what).
int64_t checked_nbytes(const char* op, const char* what, const std::vector<int64_t>& sizes, ST t);
// The device outputs go to: `device` when given, else the metadata's device. An index-less CUDA device means
// the current CUDA device. Refuses, naming op and `device`, devices packcuda has no kernels for (meta, ...) and a
// CUDA device this process cannot use (no usable GPU or driver, an index past the device count, a CPU-only build).
torch::stable::Device target_device(const char* op, const Tensor& meta,
                                    const std::optional<torch::stable::Device>& device);
// Refuses devices packcuda has no kernels for (meta, ...), naming op and name.
void check_device_kind(const char* op, const char* name, const torch::stable::Device& d);

}  // namespace packcuda::th

#include "common/errors.h"
