// Workload-balanced partitioning on the host: Karmarkar-Karp, a cap-aware first-fit-decreasing, cap repair
// and a local search. All integer arithmetic; every tie is broken by an index, so plans are deterministic.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <queue>
#include <tuple>
#include <vector>

#include "balance/balance.h"
#include "common/hd.h"

namespace packcuda::balance {
namespace {

constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

// --------------------------------------------------------------------------------- Karmarkar-Karp
// A k-way state keeps only its non-empty subsets, sorted heaviest first (ties: smaller first index); the
// k - size() empty subsets are implicitly at the end. Items of a subset form a linked list through `next`.
struct Sub {
  int64_t sum;
  int64_t min_idx;
  int64_t head, tail;
};

inline bool sub_before(const Sub& a, const Sub& b) {
  return a.sum != b.sum ? a.sum > b.sum : a.min_idx < b.min_idx;
}

struct HeapItem {
  int64_t spread;
  int64_t id;
};
struct HeapLess {  // top = largest spread, then the oldest state
  bool operator()(const HeapItem& x, const HeapItem& y) const {
    return x.spread != y.spread ? x.spread < y.spread : x.id > y.id;
  }
};

}  // namespace

void karmarkar_karp(const int64_t* weights, int64_t n, int64_t k, bool equal_count, int64_t* part) {
  if (n == 0) return;
  std::vector<int64_t> next(n, -1);
  std::vector<std::vector<Sub>> states;
  auto spread = [k](const std::vector<Sub>& s) {
    return s.front().sum - (static_cast<int64_t>(s.size()) == k ? s.back().sum : 0);
  };
  if (equal_count) {
    // Sorted heaviest first and cut into groups of k: each group is a state with one item per subset.
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return weights[a] != weights[b] ? weights[a] > weights[b] : a < b;
    });
    states.reserve(2 * (n / k));
    for (int64_t g = 0; g < n / k; ++g) {
      std::vector<Sub> s(k);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = order[g * k + j];
        s[j] = Sub{weights[i], i, i, i};
      }
      states.push_back(std::move(s));
    }
  } else {
    states.reserve(2 * n);
    for (int64_t i = 0; i < n; ++i) states.push_back({Sub{weights[i], i, i, i}});
  }
  std::priority_queue<HeapItem, std::vector<HeapItem>, HeapLess> heap;
  for (int64_t id = 0; id < static_cast<int64_t>(states.size()); ++id) heap.push({spread(states[id]), id});

  std::vector<Sub> tmp;
  while (heap.size() > 1) {
    int64_t ia = heap.top().id;
    heap.pop();
    int64_t ib = heap.top().id;
    heap.pop();
    // Subset i of the result joins A's i-th heaviest with B's i-th lightest (B[k - 1 - i]; empty when
    // k - 1 - i >= |B|). The pairing is symmetric in A and B, so A is taken as the larger state and updated
    // in place: its first `lo` subsets are untouched (still sorted); the joined ones and B's unpaired
    // heaviest ones are sorted on the side and merged in from the back.
    if (states[ib].size() > states[ia].size()) std::swap(ia, ib);
    std::vector<Sub> A = std::move(states[ia]);
    const std::vector<Sub>& B = states[ib];
    const int64_t a = static_cast<int64_t>(A.size()), b = static_cast<int64_t>(B.size());
    const int64_t lo = std::max<int64_t>(k - b, 0);  // A[i] for i >= lo has a partner in B
    tmp.clear();
    for (int64_t i = lo; i < a; ++i) {
      const Sub& x = A[i];
      const Sub& y = B[k - 1 - i];
      next[x.tail] = y.head;
      tmp.push_back(Sub{x.sum + y.sum, std::min(x.min_idx, y.min_idx), x.head, y.tail});
    }
    for (int64_t j = 0; j < std::min(k - a, b); ++j) tmp.push_back(B[j]);  // B's heaviest, paired with empties
    std::sort(tmp.begin(), tmp.end(), sub_before);
    const int64_t keep = std::min(lo, a);
    A.resize(keep + static_cast<int64_t>(tmp.size()));
    int64_t x = keep - 1, y = static_cast<int64_t>(tmp.size()) - 1;
    for (int64_t out = static_cast<int64_t>(A.size()) - 1; y >= 0; --out) {
      if (x >= 0 && sub_before(tmp[y], A[x])) A[out] = A[x--];
      else A[out] = tmp[y--];
    }
    std::vector<Sub>().swap(states[ia]);
    std::vector<Sub>().swap(states[ib]);
    const int64_t sp = spread(A);
    states.push_back(std::move(A));
    heap.push({sp, static_cast<int64_t>(states.size()) - 1});
  }
  const std::vector<Sub>& final_state = states[heap.top().id];
  for (int64_t p = 0; p < static_cast<int64_t>(final_state.size()); ++p)
    for (int64_t i = final_state[p].head; i >= 0; i = (i == final_state[p].tail ? -1 : next[i])) part[i] = p;
}

namespace {

// --------------------------------------------------------------------------------- bins + local search
// Workloads are strictly increasing in the length (coef >= 0), so sorting a bin by length sorts it by
// workload too. Each bin keeps its items sorted by (length, index).
struct Bins {
  int64_t k, cap;  // cap < 0: no token cap
  const int64_t* w;
  const int64_t* len;
  std::vector<std::vector<int64_t>> items;
  std::vector<int64_t> W, T;

  Bins(int64_t k_, int64_t cap_, const int64_t* w_, const int64_t* len_, int64_t n, const int64_t* part)
      : k(k_), cap(cap_), w(w_), len(len_), items(k_), W(k_, 0), T(k_, 0) {
    for (int64_t i = 0; i < n; ++i) {
      items[part[i]].push_back(i);
      W[part[i]] += w[i];
      T[part[i]] += len[i];
    }
    for (auto& v : items) std::sort(v.begin(), v.end(), [this](int64_t a, int64_t b) { return less(a, b); });
  }
  bool less(int64_t a, int64_t b) const { return len[a] != len[b] ? len[a] < len[b] : a < b; }
  void add(int64_t i, int64_t p) {
    auto& v = items[p];
    v.insert(std::lower_bound(v.begin(), v.end(), i, [this](int64_t a, int64_t b) { return less(a, b); }), i);
    W[p] += w[i];
    T[p] += len[i];
  }
  void remove(int64_t i, int64_t p) {
    auto& v = items[p];
    v.erase(std::lower_bound(v.begin(), v.end(), i, [this](int64_t a, int64_t b) { return less(a, b); }));
    W[p] -= w[i];
    T[p] -= len[i];
  }
  int64_t room(int64_t p) const { return cap < 0 ? kNone : cap - T[p]; }
  bool fits() const {
    for (int64_t p = 0; p < k; ++p)
      if (room(p) < 0) return false;
    return true;
  }
  // First position in bin q (from `from`) whose length is >= l.
  int64_t first_len_at_least(int64_t q, int64_t from, int64_t l) const {
    const auto& v = items[q];
    return std::partition_point(v.begin() + from, v.end(), [&](int64_t j) { return len[j] < l; }) - v.begin();
  }
};

// One step out of bin p: move item i to bin q, or swap it with a shorter item j of q. Ranked by
// (tokens still over the cap in p, the larger new workload of p and q, i, j): fix the cap first, then keep
// the balance; the index tie-breaks make the choice independent of the scan order.
struct Step {
  int64_t over = kNone, key = kNone, i = kNone, j = kNone, q = -1;
  bool found() const { return q >= 0; }
  bool swap() const { return j >= 0; }
  void offer(const Step& s) {
    if (std::tie(s.over, s.key, s.i, s.j) < std::tie(over, key, i, j)) *this = s;
  }
};

// The best step out of bin p among those whose two new workloads stay below `limit`. `excess` is p's
// token excess (0 when p fits). Moves are considered when allowed (j = -1 sorts them first on ties).
Step best_step(const Bins& bins, int64_t p, int64_t excess, int64_t limit, bool moves) {
  Step best;
  const int64_t Wp = bins.W[p];
  // Bins from the lightest: the key of any step into q is at least ceil((Wq + Wp) / 2), so once that
  // exceeds the best key found with the cap already met, no heavier bin can do better.
  std::vector<int64_t> order(bins.k);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return bins.W[a] != bins.W[b] ? bins.W[a] < bins.W[b] : a < b;
  });
  for (int64_t q : order) {
    const int64_t room = bins.room(q);
    // q takes at most `room` tokens net, so a step into it leaves p at least excess - room over the cap
    if (q == p || room <= 0 || excess - room > best.over) continue;
    const int64_t Wq = bins.W[q];
    if (best.over == 0 && (Wq + Wp + 1) / 2 > best.key) break;
    for (int64_t i : bins.items[p]) {
      const int64_t wi = bins.w[i], li = bins.len[i];
      if (li == 0) continue;
      auto consider = [&](int64_t j) {  // j = -1: a move
        const int64_t wj = j < 0 ? 0 : bins.w[j], lj = j < 0 ? 0 : bins.len[j];
        const int64_t key = std::max(Wq + wi - wj, Wp - wi + wj);
        if (key >= limit) return;
        best.offer(Step{std::max<int64_t>(excess - (li - lj), 0), key, i, j, q});
      };
      if (moves && li <= room) consider(-1);
      // swaps: j with max(li - room, 0) <= lj < li, positions [s, t) of bin q
      const int64_t s = room >= li ? 0 : bins.first_len_at_least(q, 0, li - room);
      const int64_t t = bins.first_len_at_least(q, s, li);
      if (s >= t) continue;
      // those that clear the excess: lj <= li - excess, positions [s, u)
      const int64_t u = excess > 0 ? std::min(t, bins.first_len_at_least(q, s, li - excess + 1)) : t;
      if (u == s) {  // none clears it: the shortest one removes the most tokens
        consider(bins.items[q][s]);
        continue;
      }
      // the key is smallest where Wp - wi + wj crosses Wq + wi - wj: check both sides of the crossing
      const auto& v = bins.items[q];
      const int64_t m = std::partition_point(v.begin() + s, v.begin() + u, [&](int64_t j) {
                          return 2 * bins.w[j] < Wq - Wp + 2 * wi;
                        }) - v.begin();
      if (m < u) consider(v[m]);
      if (m > s) consider(v[bins.first_len_at_least(q, s, bins.len[v[m - 1]])]);  // first of its length run
    }
  }
  return best;
}

void apply(Bins& bins, int64_t p, const Step& c) {
  bins.remove(c.i, p);
  bins.add(c.i, c.q);
  if (c.swap()) {
    bins.remove(c.j, c.q);
    bins.add(c.j, p);
  }
}

// Cap repair: while a bin is over the cap, take tokens out of the one with the largest excess, by a move or
// a swap into a bin with room. Every step lowers the total excess by at least one token, so this ends.
bool repair(Bins& bins) {
  for (;;) {
    int64_t o = -1;
    for (int64_t p = 0; p < bins.k; ++p)
      if (bins.room(p) < 0 && (o < 0 || bins.T[p] > bins.T[o])) o = p;
    if (o < 0) return true;
    const Step c = best_step(bins, o, -bins.room(o), kNone, /*moves=*/true);
    if (!c.found()) return false;
    apply(bins, o, c);
  }
}

// Local search on the heaviest bin: apply the step that lowers it most while both touched bins end strictly
// below its old workload, until none exists (or max_steps). The sorted workload vector decreases
// lexicographically at every step, so this ends.
void refine(Bins& bins, bool moves, int64_t max_steps) {
  for (int64_t step = 0; step < max_steps; ++step) {
    int64_t p = 0;
    for (int64_t q = 1; q < bins.k; ++q)
      if (bins.W[q] > bins.W[p]) p = q;
    const Step c = best_step(bins, p, 0, bins.W[p], moves);
    if (!c.found()) return;
    apply(bins, p, c);
  }
}

// --------------------------------------------------------------------------------- first fit decreasing
// Sequences by decreasing workload; each goes to the first micro-batch, scanning from the least loaded, whose
// token sum has room (if none has, to the least loaded one; the cap repair follows).
void first_fit_decreasing(const int64_t* w, const int64_t* len, int64_t n, int64_t k, int64_t cap,
                          int64_t* part) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return w[a] != w[b] ? w[a] > w[b] : a < b; });
  std::vector<int64_t> W(k, 0), T(k, 0), bins(k);  // bins sorted by (W, index)
  std::iota(bins.begin(), bins.end(), 0);
  for (int64_t i : order) {
    int64_t pos = 0;
    while (pos < k && T[bins[pos]] + len[i] > cap) ++pos;
    if (pos == k) pos = 0;
    const int64_t p = bins[pos];
    part[i] = p;
    W[p] += w[i];
    T[p] += len[i];
    // restore the order: bin p only got heavier, so bubble it towards the end
    while (pos + 1 < k && (W[bins[pos + 1]] < W[p] || (W[bins[pos + 1]] == W[p] && bins[pos + 1] < p))) {
      bins[pos] = bins[pos + 1];
      ++pos;
    }
    bins[pos] = p;
  }
}

Partition to_partition(const Bins& bins, Order order) {
  std::vector<int64_t> first(bins.k, kNone);
  for (int64_t p = 0; p < bins.k; ++p)
    for (int64_t i : bins.items[p]) first[p] = std::min(first[p], i);
  std::vector<int64_t> ids(bins.k);
  std::iota(ids.begin(), ids.end(), 0);
  if (order == Order::Pipeline) {
    std::sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) {
      return bins.W[a] != bins.W[b] ? bins.W[a] > bins.W[b] : first[a] < first[b];
    });
    // heaviest first d0 >= d1 >= ...  ->  ..., d4, d2, d0, d1, d3, ...
    std::vector<int64_t> out;
    out.reserve(bins.k);
    for (int64_t j = ((bins.k - 1) / 2) * 2; j >= 0; j -= 2) out.push_back(ids[j]);
    for (int64_t j = 1; j < bins.k; j += 2) out.push_back(ids[j]);
    ids.swap(out);
  } else {
    std::sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return first[a] < first[b] || (first[a] == first[b] && a < b); });
  }
  Partition res;
  res.offsets.reserve(bins.k + 1);
  res.offsets.push_back(0);
  for (int64_t p : ids) {
    std::vector<int64_t> v = bins.items[p];
    std::sort(v.begin(), v.end());
    res.indices.insert(res.indices.end(), v.begin(), v.end());
    res.offsets.push_back(static_cast<int64_t>(res.indices.size()));
  }
  return res;
}

int64_t refine_steps(int64_t n, int64_t k) { return 4 * (n + k) + 64; }

}  // namespace

Partition plan_micro_batches(const int64_t* seqlens, int64_t n, int64_t max_tokens, int64_t min_micro_batches,
                             int64_t multiple_of, Workload workload, int64_t coef, Method method, Order order) {
  std::vector<int64_t> w(n);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    w[i] = workload_of(seqlens[i], workload, coef);
    total += seqlens[i];
  }
  int64_t k = round_up(std::max(ceil_div(total, max_tokens), min_micro_batches), multiple_of);
  std::vector<int64_t> part(n);
  for (;;) {
    if (method == Method::KarmarkarKarp)
      karmarkar_karp(w.data(), n, k, /*equal_count=*/false, part.data());
    else
      first_fit_decreasing(w.data(), seqlens, n, k, max_tokens, part.data());
    Bins bins(k, max_tokens, w.data(), seqlens, n, part.data());
    if (!bins.fits() && !repair(bins)) {
      k += multiple_of;
      continue;
    }
    refine(bins, /*moves=*/true, refine_steps(n, k));
    return to_partition(bins, order);
  }
}

Partition balance_across_ranks(const int64_t* seqlens, int64_t n, int64_t world_size, bool equal_count,
                               Workload workload, int64_t coef) {
  std::vector<int64_t> w(n);
  for (int64_t i = 0; i < n; ++i) w[i] = workload_of(seqlens[i], workload, coef);
  std::vector<int64_t> part(n);
  karmarkar_karp(w.data(), n, world_size, equal_count, part.data());
  Bins bins(world_size, /*cap=*/-1, w.data(), seqlens, n, part.data());
  refine(bins, /*moves=*/!equal_count, refine_steps(n, world_size));
  return to_partition(bins, Order::AsPlanned);
}

}  // namespace packcuda::balance
