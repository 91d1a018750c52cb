// Torch layer of the balancing ops: schemas, argument checks, dispatch to the core planner. These ops work
// on host metadata (sequence lengths on the CPU) and have a CPU kernel only; no device is involved.
#include <limits>
#include <string>
#include <tuple>

#include "balance/balance.h"
#include "common/checked.h"
#include "common/torch/checks.h"

namespace packcuda::th {
namespace {

// Sequence lengths from a 1-D int32/int64 CPU tensor, validated: every length >= 0 (and <= max_len when
// max_len >= 0), and the total workload small enough that no partial sum can overflow int64.
std::vector<int64_t> host_lengths(const char* op, const Tensor& seqlens, int64_t max_len, const char* max_name,
                                  balance::Workload wl, int64_t coef) {
  check_dim(op, "seqlens", seqlens, 1);
  check_dtype(op, "seqlens", seqlens, {ST::Int, ST::Long});
  PC_ARG(seqlens.is_cpu(), op, "seqlens must be host metadata (a CPU tensor, list or numpy array), got a ",
         device_str(seqlens), " tensor");
  std::vector<int64_t> v = host_ints(seqlens);
  const int64_t n = static_cast<int64_t>(v.size());
  // Limit on the total workload: partial sums and the local search's trial sums stay below 2^62. Each
  // workload and the running total are checked int64 arithmetic: an overflow is refused, never wrapped.
  const int64_t limit = int64_t{1} << 61;
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    PC_ARG(v[i] >= 0, op, "seqlens[", i, "]=", v[i], " is negative");
    if (max_len >= 0)
      PC_ARG(v[i] <= max_len, op, "seqlens[", i, "]=", v[i], " exceeds ", max_name, "=", max_len,
             ": a single sequence must fit in one micro-batch");
    PC_ARG(v[i] <= (int64_t{1} << 30), op, "seqlens[", i, "]=", v[i], " is too long (at most 2^30 tokens)");
    const int64_t w =
        wl == balance::Workload::Tokens
            ? v[i]
            : checked::add(op, "the workload of seqlens (workload_coef * L + L^2)",
                           checked::mul(op, "the workload of seqlens (workload_coef * L)", coef, v[i]), v[i] * v[i]);
    total = checked::add(op, "the total workload of seqlens", total, w);
    PC_ARG(total < limit, op, "the total workload of seqlens exceeds 2^61 (workload_coef=", coef,
           "); lower workload_coef or split the batch");
  }
  return v;
}

balance::Workload parse_workload(const char* op, const std::string& s, int64_t coef) {
  PC_ARG(s == "attention" || s == "tokens", op, "workload must be 'attention' or 'tokens', got '", s, "'");
  PC_ARG(coef >= 0 && coef <= (int64_t{1} << 40), op, "workload_coef must be in [0, 2^40], got ", coef);
  return s == "tokens" ? balance::Workload::Tokens : balance::Workload::Attention;
}

std::tuple<Tensor, Tensor> to_tensors(const balance::Partition& p) {
  return std::make_tuple(upload_i64(p.indices, torch::stable::Device(torch::headeronly::DeviceType::CPU)),
                         upload_i64(p.offsets, torch::stable::Device(torch::headeronly::DeviceType::CPU)));
}

std::tuple<Tensor, Tensor> plan_micro_batches(Tensor seqlens, int64_t max_tokens, int64_t min_micro_batches,
                                              int64_t multiple_of, std::string workload, int64_t workload_coef,
                                              std::string method, std::string order) {
  const char* op = "plan_micro_batches";
  PC_ARG(max_tokens >= 1, op, "max_tokens must be >= 1, got ", max_tokens);
  PC_ARG(min_micro_batches >= 1, op, "min_micro_batches must be >= 1, got ", min_micro_batches);
  PC_ARG(multiple_of >= 1, op, "multiple_of must be >= 1, got ", multiple_of);
  PC_ARG(min_micro_batches <= (int64_t{1} << 20) && multiple_of <= (int64_t{1} << 20), op,
         "min_micro_batches and multiple_of must be at most 2^20, got ", min_micro_batches, " and ", multiple_of);
  const balance::Workload wl = parse_workload(op, workload, workload_coef);
  PC_ARG(method == "karmarkar_karp" || method == "first_fit_decreasing", op,
         "method must be 'karmarkar_karp' or 'first_fit_decreasing', got '", method, "'");
  PC_ARG(order == "as_planned" || order == "pipeline", op, "order must be 'as_planned' or 'pipeline', got '", order,
         "'");
  const std::vector<int64_t> lens = host_lengths(op, seqlens, max_tokens, "max_tokens", wl, workload_coef);
  const balance::Partition plan = balance::plan_micro_batches(
      lens.data(), static_cast<int64_t>(lens.size()), max_tokens, min_micro_batches, multiple_of, wl, workload_coef,
      method == "karmarkar_karp" ? balance::Method::KarmarkarKarp : balance::Method::FirstFitDecreasing,
      order == "pipeline" ? balance::Order::Pipeline : balance::Order::AsPlanned);
  return to_tensors(plan);
}

std::tuple<Tensor, Tensor> balance_across_ranks(Tensor seqlens, int64_t world_size, bool equal_count,
                                                std::string workload, int64_t workload_coef) {
  const char* op = "balance_across_ranks";
  PC_ARG(world_size >= 1 && world_size <= (int64_t{1} << 20), op, "world_size must be in [1, 2^20], got ", world_size);
  const balance::Workload wl = parse_workload(op, workload, workload_coef);
  const std::vector<int64_t> lens = host_lengths(op, seqlens, -1, "", wl, workload_coef);
  const int64_t n = static_cast<int64_t>(lens.size());
  if (equal_count)
    PC_ARG(n % world_size == 0, op, "equal_count needs the number of sequences (", n,
           ") to be a multiple of world_size (", world_size, ")");
  return to_tensors(balance::balance_across_ranks(lens.data(), n, world_size, equal_count, wl, workload_coef));
}

}  // namespace
}  // namespace packcuda::th

STABLE_TORCH_LIBRARY_FRAGMENT(packcuda, m) {
  m.def(
      "plan_micro_batches(Tensor seqlens, int max_tokens, int min_micro_batches=1, int multiple_of=1, "
      "str workload=\"attention\", int workload_coef=24576, str method=\"karmarkar_karp\", "
      "str order=\"as_planned\") -> (Tensor, Tensor)");
  m.def(
      "balance_across_ranks(Tensor seqlens, int world_size, bool equal_count=False, "
      "str workload=\"attention\", int workload_coef=24576) -> (Tensor, Tensor)");
}

// Host metadata work: a CPU kernel (the facade hands CPU tensors; a device tensor is refused).
#define PC_BALANCE_IMPLS(m)                                            \
  PC_IMPL(m, "plan_micro_batches", &packcuda::th::plan_micro_batches); \
  PC_IMPL(m, "balance_across_ranks", &packcuda::th::balance_across_ranks);

STABLE_TORCH_LIBRARY_IMPL(packcuda, CPU, m) { PC_BALANCE_IMPLS(m) }
#ifdef USE_CUDA
// registered for CUDA too, only so that a device tensor gets the op's own clear refusal
STABLE_TORCH_LIBRARY_IMPL(packcuda, CUDA, m) {
  PC_BALANCE_IMPLS(m)
}
#endif
