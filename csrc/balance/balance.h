// packcuda core: workload-balanced partitioning of variable-length sequences (host metadata work, no torch,
// no device). Everything is integer arithmetic with deterministic tie-breaking, so the same input gives the
// same plan on every rank and every run.
#pragma once
#include <cstdint>
#include <vector>

namespace packcuda::balance {

enum class Workload : int { Tokens = 0, Attention = 1 };
enum class Method : int { KarmarkarKarp = 0, FirstFitDecreasing = 1 };
enum class Order : int { AsPlanned = 0, Pipeline = 1 };

// Cost of one sequence of `len` tokens: `len` (Tokens) or `coef * len + len * len` (Attention: a linear
// term for the dense layers plus the quadratic attention term).
inline int64_t workload_of(int64_t len, Workload w, int64_t coef) {
  return w == Workload::Tokens ? len : coef * len + len * len;
}

// A partition in CSR form: part p holds indices[offsets[p], offsets[p + 1]), ascending. Parts may be empty.
struct Partition {
  std::vector<int64_t> offsets;  // parts + 1 entries, offsets[0] = 0
  std::vector<int64_t> indices;  // every input index exactly once
  int64_t parts() const { return static_cast<int64_t>(offsets.size()) - 1; }
};

// Multi-way largest differencing (Karmarkar-Karp) of `weights` (n entries, >= 0) into k >= 1 parts:
// part[i] in [0, k). equal_count (n % k == 0): every part gets n / k items (the weights are sorted, cut into
// groups of k, and each group starts as one k-way state). Ties are broken as verl's
// get_seqlen_balanced_partitions breaks them (see balance_cpu.cpp), so the two make the same partition of the
// same weights; deterministic. Exposed for tests and C++ users; the planners below add the token cap and a
// local search, which start from this partition whenever it meets the cap: their largest workload is then never
// above the plain Karmarkar-Karp split's.
void karmarkar_karp(const int64_t* weights, int64_t n, int64_t k, bool equal_count, int64_t* part);

// Micro-batches under a token cap. Preconditions (checked by the torch layer): 0 <= seqlens[i] <= max_tokens,
// min_micro_batches >= 1, multiple_of >= 1, coef >= 0, and the total workload fits comfortably in int64.
//  - count: start at max(ceil(sum / max_tokens), min_micro_batches) rounded up to multiple_of;
//  - partition the workloads into that many micro-batches (KK or first-fit-decreasing, see docs/design.md);
//  - if a micro-batch exceeds max_tokens, repair by moving / swapping sequences into micro-batches with room;
//    only when that fails, add multiple_of micro-batches and start over (terminates: with one sequence per
//    micro-batch every cap holds);
//  - local search on the heaviest micro-batch while a step lowers it and keeps every cap: moves and swaps,
//    then one-for-two / two-for-one exchanges with the lightest micro-batches, then moves and swaps again.
//    Every step leaves both touched micro-batches strictly below the old maximum, so the largest workload
//    never rises;
//  - order: AsPlanned = by smallest sequence index (empty micro-batches last); Pipeline = heaviest in the
//    middle, lighter towards both ends.
// Every micro-batch's token sum is <= max_tokens.
Partition plan_micro_batches(const int64_t* seqlens, int64_t n, int64_t max_tokens, int64_t min_micro_batches,
                             int64_t multiple_of, Workload workload, int64_t coef, Method method, Order order);

// Partition across world_size data-parallel ranks (no cap): KK plus the same local search (swaps only when
// equal_count, which needs n % world_size == 0). Part r is rank r's sequences; parts are ordered by their
// smallest index (empty ones last).
Partition balance_across_ranks(const int64_t* seqlens, int64_t n, int64_t world_size, bool equal_count,
                               Workload workload, int64_t coef);

}  // namespace packcuda::balance
