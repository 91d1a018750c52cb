// Workload-balanced partitioning on the host: Karmarkar-Karp, a cap-aware first-fit-decreasing, cap repair
// and a local search. All integer arithmetic; every tie is broken by an index, so plans are deterministic.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <queue>
#include <set>
#include <tuple>
#include <vector>

#include "balance/balance.h"
#include "common/checked.h"
#include "common/hd.h"

namespace packcuda::balance {
namespace {

constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

// --------------------------------------------------------------------------------- Karmarkar-Karp
// A k-way state keeps only its non-empty subsets, heaviest first; the k - size() empty subsets are implicitly
// at the end. Items of a subset form a linked list through `next`, in the order they joined it.
//
// Ties are broken exactly as verl's get_seqlen_balanced_partitions (verl.utils.seqlen_balancing) breaks
// them, so that both give the same partition of the same weights: subsets are ordered by (sum, item count,
// index of the first item to join), the larger first; of two states, the one of larger spread merges first,
// then the one whose heaviest subset comes first in that order; a merge lists the first state's items before
// the second's. Subsets are disjoint, so the order is strict and the merges happen in one determined order.
struct Sub {
  int64_t sum;
  int64_t count;
  int64_t first;  // index of the first item of the list
  int64_t tail;   // index of the last item of the list
};

inline bool sub_before(const Sub& a, const Sub& b) {
  return std::tie(a.sum, a.count, a.first) > std::tie(b.sum, b.count, b.first);
}

struct HeapItem {
  int64_t spread;
  Sub top;  // the state's heaviest subset
  int64_t id;
};
struct HeapLess {  // top = largest spread, then the heaviest subset first in sub_before's order
  bool operator()(const HeapItem& x, const HeapItem& y) const {
    return x.spread != y.spread ? x.spread < y.spread : sub_before(y.top, x.top);
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
    // Sorted lightest first (ties: smaller index) and cut into groups of k: each group is a state with one
    // item per subset.
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](int64_t a, int64_t b) { return weights[a] != weights[b] ? weights[a] < weights[b] : a < b; });
    states.reserve(2 * (n / k));
    for (int64_t g = 0; g < n / k; ++g) {
      std::vector<Sub> s(k);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = order[g * k + j];
        s[j] = Sub{weights[i], 1, i, i};
      }
      std::sort(s.begin(), s.end(), sub_before);
      states.push_back(std::move(s));
    }
  } else {
    states.reserve(2 * n);
    for (int64_t i = 0; i < n; ++i) states.push_back({Sub{weights[i], 1, i, i}});
  }
  std::priority_queue<HeapItem, std::vector<HeapItem>, HeapLess> heap;
  for (int64_t id = 0; id < static_cast<int64_t>(states.size()); ++id)
    heap.push({spread(states[id]), states[id].front(), id});

  std::vector<Sub> tmp;
  while (heap.size() > 1) {
    int64_t ia = heap.top().id;
    heap.pop();
    int64_t ib = heap.top().id;
    heap.pop();
    // Subset i of the result joins A's i-th heaviest with B's i-th lightest (B[k - 1 - i]; empty when
    // k - 1 - i >= |B|). The pairing is symmetric in A and B, so A is taken as the larger state and updated
    // in place: its first `lo` subsets are untouched (still sorted); the joined ones and B's unpaired
    // heaviest ones are sorted on the side and merged in from the back. A joined subset lists the items of
    // the state popped first before the other's.
    const bool a_first = states[ib].size() <= states[ia].size();
    if (!a_first) std::swap(ia, ib);
    std::vector<Sub> A = std::move(states[ia]);
    const std::vector<Sub>& B = states[ib];
    const int64_t a = static_cast<int64_t>(A.size()), b = static_cast<int64_t>(B.size());
    const int64_t lo = std::max<int64_t>(k - b, 0);  // A[i] for i >= lo has a partner in B
    tmp.clear();
    for (int64_t i = lo; i < a; ++i) {
      const Sub& x = a_first ? A[i] : B[k - 1 - i];  // first in the joined list
      const Sub& y = a_first ? B[k - 1 - i] : A[i];
      next[x.tail] = y.first;
      tmp.push_back(Sub{x.sum + y.sum, x.count + y.count, x.first, y.tail});
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
    const Sub top = A.front();
    states.push_back(std::move(A));
    heap.push({sp, top, static_cast<int64_t>(states.size()) - 1});
  }
  const std::vector<Sub>& final_state = states[heap.top().id];
  for (int64_t p = 0; p < static_cast<int64_t>(final_state.size()); ++p)
    for (int64_t i = final_state[p].first; i >= 0; i = (i == final_state[p].tail ? -1 : next[i])) part[i] = p;
}

namespace {

// --------------------------------------------------------------------------------- bins + local search
// Workloads are non-decreasing in the length (coef >= 0), so sorting a bin by length sorts it by workload
// too. Each bin keeps its items sorted by (length, index). Two ordered indexes keep every step's bookkeeping
// at O(log k) and let the searches stop early instead of scanning all bins: by workload (the heaviest is the
// local search's target; partners come lightest first) and by token sum (the fullest is the repair's target;
// partners for single steps come with the most room first).
constexpr int64_t kNoCap = int64_t{1} << 62;  // room of a bin without a cap; lengths are <= 2^30

struct Bins {
  int64_t k, cap;  // cap < 0: no token cap
  const int64_t* w;
  const int64_t* len;
  Workload workload;
  int64_t coef;
  std::vector<std::vector<int64_t>> items;
  std::vector<int64_t> W, T;
  // Deterministic work counter: candidate steps offered plus items scanned. The repair and the local
  // search stop when it passes their budget, which bounds a planner call's time on any input.
  int64_t work = 0;
  std::set<std::pair<int64_t, int64_t>> by_load;    // (W[p], p), every bin
  std::set<std::pair<int64_t, int64_t>> by_tokens;  // (T[p], p), every bin: the most room first

  Bins(int64_t k_, int64_t cap_, const int64_t* w_, const int64_t* len_, Workload wl_, int64_t coef_, int64_t n,
       const int64_t* part)
      : k(k_), cap(cap_), w(w_), len(len_), workload(wl_), coef(coef_), items(k_), W(k_, 0), T(k_, 0) {
    for (int64_t i = 0; i < n; ++i) {
      items[part[i]].push_back(i);
      W[part[i]] += w[i];
      T[part[i]] += len[i];
    }
    for (auto& v : items) std::sort(v.begin(), v.end(), [this](int64_t a, int64_t b) { return less(a, b); });
    for (int64_t p = 0; p < k; ++p) index(p);
  }
  // Workload of a hypothetical length l >= 0 (a pruning bound), saturated at int64 max instead of wrapping:
  // the bounds it feeds only get looser, never wrong.
  int64_t wl(int64_t l) const {
    if (workload == Workload::Tokens) return l;
    int64_t a, b, r;
    if (__builtin_mul_overflow(coef, l, &a) || __builtin_mul_overflow(l, l, &b) || __builtin_add_overflow(a, b, &r))
      return std::numeric_limits<int64_t>::max();
    return r;
  }
  bool less(int64_t a, int64_t b) const { return len[a] != len[b] ? len[a] < len[b] : a < b; }
  int64_t room(int64_t p) const { return cap < 0 ? kNoCap : cap - T[p]; }
  void index(int64_t p) {
    by_load.emplace(W[p], p);
    by_tokens.emplace(T[p], p);
  }
  void unindex(int64_t p) {
    by_load.erase({W[p], p});
    by_tokens.erase({T[p], p});
  }
  // Item moves; the caller unindexes the touched bins before and indexes them after.
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
  // First position in v[from, to) whose length is >= l.
  int64_t first_len_at_least(const std::vector<int64_t>& v, int64_t from, int64_t to, int64_t l) const {
    return std::partition_point(v.begin() + from, v.begin() + to, [&](int64_t j) { return len[j] < l; }) - v.begin();
  }
};

// One exchange between bin p and bin q: p gives `give` (up to two items) to q and takes `take` (up to two)
// from it. Kinds: move (1, 0), swap (1, 1), one for two (1, 2), two for one (2, 1). Ranked by (tokens still
// over the cap in p, the larger new workload of p and q, fewer items, item indices, q).
struct Step {
  int64_t over = kNone, key = kNone, q = -1;
  int64_t give[2] = {-1, -1}, take[2] = {-1, -1};
  bool found() const { return q >= 0; }
  auto rank() const {
    const int n = (give[0] >= 0) + (give[1] >= 0) + (take[0] >= 0) + (take[1] >= 0);
    return std::make_tuple(over, key, n, give[0], give[1], take[0], take[1], q);
  }
};

// Exchanges searched: single steps (moves, off when the item counts are fixed, and swaps) and pair exchanges
// (one for two, two for one), which change a bin's workload at an almost unchanged token sum: when the cap
// binds, they are often the only steps left. Pair exchanges cost O(|p| + |q|) per item of the other bin, so
// a search tries them with at most kPairPartners partners (the lightest that can take part) and only for
// bins of at most kPairItems items (larger bins have fine-grained single steps anyway).
struct Kinds {
  bool moves, singles, pairs;
};
constexpr int64_t kPairItems = 64;
constexpr int64_t kPairPartners = 32;

// For each a (ascending) calls f(a, x0, x1), where [x0, x1) are the positions x > a of v whose length sum
// with v[a] lies in [s0, s1] (skipped when empty). v is sorted by length, so both ends only move down as a
// grows: O(|v|) in all.
template <class F>
void pair_windows(const Bins& bins, const std::vector<int64_t>& v, int64_t s0, int64_t s1, F&& f) {
  const int64_t n = static_cast<int64_t>(v.size());
  int64_t x0 = n, x1 = n;
  for (int64_t a = 0; a + 1 < n; ++a) {
    const int64_t la = bins.len[v[a]];
    while (x1 > 0 && la + bins.len[v[x1 - 1]] > s1) --x1;
    if (x1 <= a + 1) return;
    while (x0 > 0 && la + bins.len[v[x0 - 1]] >= s0) --x0;
    const int64_t lo = std::max(x0, a + 1);
    if (lo < x1) f(a, lo, x1);
  }
}

// The best step out of bin p whose two new workloads stay below `limit`. Repair (p over the cap): the step
// must take tokens out of p, and steps that bring p under the cap come first. Local search (p fits): p must
// still fit afterwards. q always fits afterwards.
Step best_step(Bins& bins, int64_t p, int64_t limit, Kinds kinds) {
  Step best;
  int64_t& work = bins.work;
  const int64_t Wp = bins.W[p];
  const int64_t z = bins.room(p);     // p's token change dT <= z leaves it within the cap
  const int64_t hi = z < 0 ? -1 : z;  // allowed token change of p: the repair must lower it
  const bool repairing = z < 0;
  const int64_t excess = repairing ? -z : 0;
  const auto& P = bins.items[p];
  const int64_t np = static_cast<int64_t>(P.size());
  if (np == 0) return best;
  const int64_t* w = bins.w;
  const int64_t* len = bins.len;
  const int64_t Lp = len[P.back()];
  // A single step with q lowers Wp by at most w(Lp) - w(Lp - room_q): w is convex with w(0) = 0.
  auto single_gain = [&](int64_t room_q) { return bins.wl(Lp) - bins.wl(std::max<int64_t>(Lp - room_q, 0)); };

  auto offer = [&](int64_t q, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
    ++work;
    int64_t dT = 0, dW = 0;
    for (int64_t x : {g0, g1})
      if (x >= 0) dT -= len[x], dW -= w[x];
    for (int64_t x : {t0, t1})
      if (x >= 0) dT += len[x], dW += w[x];
    const int64_t over = std::max<int64_t>(dT - z, 0), key = std::max(Wp + dW, bins.W[q] - dW);
    if (key >= limit || over > best.over || (over == best.over && key > best.key)) return;
    Step s;
    s.over = over, s.key = key, s.q = q;
    s.give[0] = g0, s.give[1] = g1, s.take[0] = t0, s.take[1] = t1;
    if (s.rank() < best.rank()) best = s;
  };

  // Moves and swaps with q. p's token change dT must lie in [lo, hi]; its part dT <= z leaves p under the
  // cap, and there the key max(Wp + dW, Wq - dW) is smallest next to where 2 dW crosses Wq - Wp. When that
  // part is empty (repair), the step taking the most tokens out of p is offered.
  auto singles = [&](int64_t q) {
    const auto& Q = bins.items[q];
    work += 1 + np + static_cast<int64_t>(Q.size());
    const int64_t lo = -bins.room(q), target = bins.W[q] - Wp;
    // In the local search only the x with w(l_x) - w(l_x - room_q) above the needed gain can help (moved
    // or swapped for a shorter j): a suffix of p, from s0.
    int64_t s0 = 0;
    if (!repairing) {
      const int64_t need = Wp - std::min(limit, best.key);
      s0 = std::partition_point(P.begin(), P.end(),
                                [&](int64_t x) { return w[x] - bins.wl(std::max<int64_t>(len[x] + lo, 0)) <= need; }) -
           P.begin();
      if (s0 == np) return;
    }
    if (kinds.moves) {  // p gives x: dT = -l_x
      const int64_t a = bins.first_len_at_least(P, s0, np, -hi), b = bins.first_len_at_least(P, a, np, -lo + 1);
      const int64_t za = std::max(a, bins.first_len_at_least(P, s0, np, -z));
      if (za < b) {
        const int64_t m =
            std::partition_point(P.begin() + za, P.begin() + b, [&](int64_t x) { return -2 * w[x] >= target; }) -
            P.begin();
        if (m < b) offer(q, P[m], -1, -1, -1);
        if (m > za) offer(q, P[m - 1], -1, -1, -1);
      } else if (a < b && best.over > 0) {
        offer(q, P[b - 1], -1, -1, -1);
      }
    }
    // swaps: p takes j (ascending), gives x with l_x in [l_j - hi, l_j - lo], under the cap from l_j - z.
    // All window ends and the crossing only move up with j: O(|p| + |q|); the j start at the suffix's
    // shortest length - room_q.
    int64_t a = s0, b = s0, za = s0, c = s0;
    const int64_t j0 = repairing ? 0 : bins.first_len_at_least(Q, 0, static_cast<int64_t>(Q.size()), len[P[s0]] + lo);
    for (auto jt = Q.begin() + j0; jt != Q.end(); ++jt) {
      const int64_t j = *jt, lj = len[j];
      if (!repairing && lj >= Lp) break;  // taking j for a shorter or equal x does not lower Wp
      while (a < np && len[P[a]] < lj - hi) ++a;
      while (b < np && len[P[b]] <= lj - lo) ++b;
      while (za < np && len[P[za]] < lj - z) ++za;
      const int64_t zs = std::max(a, za);
      if (zs < b) {
        c = std::max(c, zs);
        while (c < b && 2 * (w[j] - w[P[c]]) >= target) ++c;
        if (c < b) offer(q, P[c], -1, j, -1);
        if (c > zs) offer(q, P[c - 1], -1, j, -1);
      } else if (a < b && best.over > 0) {
        offer(q, P[b - 1], -1, j, -1);
      }
    }
  };

  // One-for-two and two-for-one exchanges with q, found the same way through pair_windows.
  auto pairs = [&](int64_t q) {
    const auto& Q = bins.items[q];
    if (Q.empty()) return;
    work += (1 + np + static_cast<int64_t>(Q.size())) * (1 + np + static_cast<int64_t>(Q.size()));
    const int64_t lo = -bins.room(q), target = bins.W[q] - Wp;
    // Local search: p must gain more than `need`. Giving i for two items of total length >= l_i - room_q
    // gains at most w(l_i) - 2 w((l_i - room_q) / 2) (convexity), which grows with l_i: a suffix of p.
    const int64_t need = repairing ? std::numeric_limits<int64_t>::min() : Wp - std::min(limit, best.key);
    const int64_t s1 = repairing ? 0 : std::partition_point(P.begin(), P.end(), [&](int64_t x) {
                                         return w[x] - 2 * bins.wl(std::max<int64_t>(len[x] + lo, 0) / 2) <= need;
                                       }) - P.begin();
    for (auto it = P.begin() + s1; it != P.end(); ++it) {  // p gives i, takes Q[a] and Q[x]: dT = l_Qa + l_Qx - l_i
      const int64_t i = *it, li = len[i];
      pair_windows(bins, Q, li + lo, li + z, [&](int64_t a, int64_t x0, int64_t x1) {
        const int64_t base = w[Q[a]] - w[i];
        const int64_t m = std::partition_point(Q.begin() + x0, Q.begin() + x1,
                                               [&](int64_t x) { return 2 * (base + w[x]) < target; }) -
                          Q.begin();
        if (m < x1) offer(q, i, -1, Q[a], Q[m]);
        if (m > x0) offer(q, i, -1, Q[a], Q[m - 1]);
      });
      if (best.over > 0)  // repair, nothing clears the excess yet: the pair taking the fewest tokens
        pair_windows(bins, Q, li + lo, li + hi, [&](int64_t a, int64_t x0, int64_t) { offer(q, i, -1, Q[a], Q[x0]); });
    }
    // Giving two items of total length <= l_j + room_q for j gains at most w(l_j + room_q) - w(l_j) (w is
    // superadditive), which grows with l_j.
    if (!repairing && -lo <= (int64_t{1} << 31) && bins.wl(len[Q.back()] - lo) - bins.wl(len[Q.back()]) <= need) return;
    for (int64_t j : Q) {  // p gives P[a] and P[x], takes j: dT = l_j - l_Pa - l_Px
      const int64_t lj = len[j];
      pair_windows(bins, P, lj - z, lj - lo, [&](int64_t a, int64_t x0, int64_t x1) {
        const int64_t base = w[j] - w[P[a]];
        const int64_t m = std::partition_point(P.begin() + x0, P.begin() + x1,
                                               [&](int64_t x) { return 2 * (base - w[x]) >= target; }) -
                          P.begin();
        if (m < x1) offer(q, P[a], P[m], j, -1);
        if (m > x0) offer(q, P[a], P[m - 1], j, -1);
      });
      if (best.over > 0)
        pair_windows(bins, P, lj - hi, lj - lo,
                     [&](int64_t a, int64_t, int64_t x1) { offer(q, P[a], P[x1 - 1], j, -1); });
    }
  };

  // Partners for single steps. With a cap: the most room first, since a single step moves at most room_q
  // tokens net into q: the repair stops once room_q cannot beat the best step's remaining excess (or, with
  // one clearing the excess found, cannot clear it), the local search once single_gain(room_q) cannot beat
  // the best key. Any step with q also has key >= ceil((Wp + Wq) / 2).
  auto skip_half = [&](int64_t Wq) {
    const int64_t half = (Wp + Wq + 1) / 2;
    return half >= limit || (best.over == 0 && half > best.key);
  };
  if (kinds.singles && bins.cap >= 0) {
    for (const auto& [Tq, q] : bins.by_tokens) {
      ++work;
      if (q == p) continue;
      const int64_t room_q = bins.cap - Tq;
      if (repairing) {
        if (room_q <= 0 || excess - room_q > best.over || (best.over == 0 && room_q < excess)) break;
        // a step clearing the excess moves l >= excess tokens net into q, which costs q at least w(excess)
        if (best.over == 0 && bins.W[q] + bins.wl(excess) >= best.key) continue;
      } else if (Wp - single_gain(room_q) >= std::min(limit, best.key)) {
        break;
      }
      if (!skip_half(bins.W[q])) singles(q);
    }
  } else if (kinds.singles) {
    for (const auto& [Wq, q] : bins.by_load) {
      ++work;
      if (q == p) continue;
      if (skip_half(Wq)) break;
      singles(q);
    }
  }
  // Partners for pair exchanges: the lightest kPairPartners that can take part.
  if (!kinds.pairs || np > kPairItems) return best;
  int64_t tried = 0;
  for (const auto& [Wq, q] : bins.by_load) {
    ++work;
    if (tried >= kPairPartners || skip_half(Wq)) break;
    const int64_t room_q = bins.room(q);
    if (q == p || static_cast<int64_t>(bins.items[q].size()) > kPairItems ||
        (repairing && (room_q <= 0 || excess - room_q > best.over)))
      continue;
    ++tried;
    pairs(q);
  }
  return best;
}

void apply(Bins& bins, int64_t p, const Step& c) {
  bins.unindex(p);
  bins.unindex(c.q);
  for (int64_t x : c.give)
    if (x >= 0) bins.remove(x, p), bins.add(x, c.q);
  for (int64_t x : c.take)
    if (x >= 0) bins.remove(x, c.q), bins.add(x, p);
  bins.index(p);
  bins.index(c.q);
}

// Cap repair: while a bin is over the cap, take tokens out of the one with the largest token sum by an
// exchange with a bin that stays within the cap. Every step lowers the total excess by at least one token,
// so this ends; it also gives up (false) once bins.work passes work_limit.
bool repair(Bins& bins, Kinds kinds, int64_t work_limit) {
  while (bins.room(bins.by_tokens.rbegin()->second) < 0) {
    if (bins.work > work_limit) return false;
    const int64_t o = bins.by_tokens.rbegin()->second;
    const Step c = best_step(bins, o, kNone, kinds);
    if (!c.found()) return false;
    apply(bins, o, c);
  }
  return true;
}

// Local search on the heaviest bin: apply the step that lowers it most while both touched bins end strictly
// below its old workload, until none exists (or max_steps). The sorted workload vector decreases
// lexicographically at every step, so this ends.
// It also stops once the heaviest is within 1/kTolerance of the mean, which no plan can beat: steps there
// would cost time for no measurable balance.
constexpr int64_t kTolerance = 10000;

void refine(Bins& bins, Kinds kinds, int64_t max_steps, int64_t work_limit) {
  int64_t total = 0;
  for (int64_t v : bins.W) total += v;
  const int64_t mean = total / bins.k, slack = mean / kTolerance;
  for (int64_t step = 0; step < max_steps && bins.work <= work_limit; ++step) {
    const int64_t p = bins.by_load.rbegin()->second;
    if (bins.W[p] - mean <= slack) return;
    const Step c = best_step(bins, p, bins.W[p], kinds);
    if (!c.found()) return;
    apply(bins, p, c);
  }
}

// --------------------------------------------------------------------------------- first fit decreasing
// Sequences by decreasing workload; each goes to the first micro-batch, scanning from the least loaded, whose
// token sum has room (if none has, to the least loaded one; the cap repair follows).
// The least loaded bin with room is found in O(log k): a min segment tree over the bins holds (W, index) of
// every bin with room for the current sequence; the others wait in a max-heap by room and rejoin the tree
// once the (non-increasing) lengths fit them again.
void first_fit_decreasing(const int64_t* w, const int64_t* len, int64_t n, int64_t k, int64_t cap, int64_t* part) {
  using Key = std::pair<int64_t, int64_t>;
  const Key none{kNone, kNone};
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return w[a] != w[b] ? w[a] > w[b] : a < b; });
  std::vector<int64_t> W(k, 0), T(k, 0);
  int64_t size = 1;
  while (size < k) size *= 2;
  std::vector<Key> tree(2 * size, none);  // bins with room for the current length
  auto set_leaf = [&](int64_t p, Key v) {
    int64_t node = size + p;
    tree[node] = v;
    for (node /= 2; node >= 1; node /= 2) tree[node] = std::min(tree[2 * node], tree[2 * node + 1]);
  };
  for (int64_t p = 0; p < k; ++p) tree[size + p] = Key{0, p};
  for (int64_t node = size - 1; node >= 1; --node) tree[node] = std::min(tree[2 * node], tree[2 * node + 1]);
  std::set<Key> all;  // every bin by (W, index): the least loaded when none has room
  for (int64_t p = 0; p < k; ++p) all.emplace(0, p);
  std::priority_queue<Key> waiting;  // (room, bin) of bins out of the tree
  for (int64_t i : order) {
    while (!waiting.empty() && waiting.top().first >= len[i]) {
      const auto [room, p] = waiting.top();
      waiting.pop();
      if (room == cap - T[p]) set_leaf(p, Key{W[p], p});  // else a stale entry: p filled up since
    }
    const int64_t p = tree[1] != none ? tree[1].second : all.begin()->second;
    part[i] = p;
    all.erase(Key{W[p], p});
    W[p] += w[i];
    T[p] += len[i];
    all.emplace(W[p], p);
    if (cap - T[p] >= len[i]) {
      set_leaf(p, Key{W[p], p});
    } else {
      set_leaf(p, none);
      waiting.emplace(cap - T[p], p);
    }
  }
}

// Lower bound on the number of bins of capacity cap (>= every length) that can hold these lengths: no
// partition into fewer meets the cap. The largest of: ceil(sum / cap); for j >= 1, the lengths above
// cap / (j + 1) fit at most j to a bin; Martello and Toth's L2 (for each K <= cap / 2: the lengths above
// cap - K each need a bin of their own, those in (cap / 2, cap - K] too, and the lengths in [K, cap / 2]
// fill what those leave free before needing more). O(n log n).
int64_t min_bins(const int64_t* len, int64_t n, int64_t cap) {
  if (n == 0) return 0;
  std::vector<int64_t> v(len, len + n);
  std::sort(v.begin(), v.end(), std::greater<int64_t>());  // longest first
  std::vector<__int128> pre(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) pre[i + 1] = pre[i] + v[i];
  const __int128 c = cap;
  // count of lengths l with pred(l) true, where pred holds for a prefix of the (descending) order
  auto count = [&](auto pred) { return std::partition_point(v.begin(), v.end(), pred) - v.begin(); };
  __int128 best = (pre[n] + c - 1) / c;
  for (int64_t j = 1; j <= 64 && (n + j - 1) / j > best; ++j) {  // ceil(n / j) bounds the j-th term
    const int64_t cj = count([&](int64_t l) { return static_cast<__int128>(l) * (j + 1) > c; });
    best = std::max<__int128>(best, (cj + j - 1) / j);
  }
  const int64_t half = count([&](int64_t l) { return 2 * static_cast<__int128>(l) > c; });  // l > cap / 2
  // K = 0, then every distinct length K <= cap / 2
  for (int64_t i = half - 1; i < n; ++i) {
    const int64_t K = i < half ? 0 : v[i];
    if (i >= half && i + 1 < n && v[i + 1] == K) continue;  // the last position of this length
    const int64_t j1 = count([&](int64_t l) { return static_cast<__int128>(l) > c - K; });
    const int64_t j2 = half - std::min(j1, half);
    const int64_t e3 = i < half ? n : i + 1;  // lengths in [K, cap / 2]: positions [half, e3)
    const __int128 s2 = pre[half] - pre[std::min(j1, half)], s3 = pre[e3] - pre[half];
    const __int128 free2 = static_cast<__int128>(j2) * c - s2;
    const __int128 extra = s3 > free2 ? (s3 - free2 + c - 1) / c : 0;
    best = std::max<__int128>(best, static_cast<__int128>(std::max(j1, half)) + extra);
  }
  return static_cast<int64_t>(std::min<__int128>(best, n));
}

// First-fit decreasing bin packing by tokens (longest first, each into the first bin with room): a plan that
// always meets the cap, with at most 11/9 of the fewest bins possible plus one. part[i] = bin; returns the
// number of bins. A segment tree over the bins' rooms finds the first bin with room in O(log n).
int64_t pack_tokens(const int64_t* len, int64_t n, int64_t cap, int64_t* part) {
  if (n == 0) return 0;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return len[a] != len[b] ? len[a] > len[b] : a < b; });
  int64_t size = 1;
  while (size < n) size *= 2;
  std::vector<int64_t> room(2 * size, cap);  // a leaf per possible bin (n at most); node = max room below
  int64_t used = 0;
  for (int64_t i : order) {
    int64_t node = 1;
    while (node < size) node = room[2 * node] >= len[i] ? 2 * node : 2 * node + 1;
    const int64_t b = node - size;
    part[i] = b;
    used = std::max(used, b + 1);
    room[node] -= len[i];
    for (node /= 2; node >= 1; node /= 2) room[node] = std::max(room[2 * node], room[2 * node + 1]);
  }
  return used;
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
    std::sort(ids.begin(), ids.end(),
              [&](int64_t a, int64_t b) { return first[a] < first[b] || (first[a] == first[b] && a < b); });
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

// Work budgets (units of Bins::work: a candidate step offered or an item scanned; about 10 ns each). The
// repair attempts may spend kRepairWork in all; the local search kSearchWork; the count scan tries counts while
// the attempts' sizes (n + k each) sum to at most kScanWork, then jumps to the count that the token packing
// needs. Together they bound a planner call on any input (tens of milliseconds for 16k sequences); on
// ordinary batches none of them is reached.
constexpr int64_t kRepairWork = int64_t{1} << 23;
constexpr int64_t kSearchWork = int64_t{1} << 24;
constexpr int64_t kScanWork = int64_t{1} << 19;

// The local search, unless no step can lower the heaviest bin: every bin holds at most one sequence.
void search(Bins& bins, int64_t n, bool moves, bool pairs) {
  bool single = true;
  for (const auto& v : bins.items) single = single && v.size() <= 1;
  if (single) return;
  const int64_t limit = bins.work + kSearchWork;
  // Single steps to convergence, then the one-for-two / two-for-one exchanges (which the singles cannot
  // find), then single steps again on what they changed.
  refine(bins, Kinds{moves, true, false}, refine_steps(n, bins.k), limit);
  if (!pairs) return;
  refine(bins, Kinds{moves, false, true}, refine_steps(n, bins.k), limit);
  refine(bins, Kinds{moves, true, false}, refine_steps(n, bins.k), limit);
}

}  // namespace

Partition plan_micro_batches(const int64_t* seqlens, int64_t n, int64_t max_tokens, int64_t min_micro_batches,
                             int64_t multiple_of, Workload workload, int64_t coef, Method method, Order order) {
  const char* op = "plan_micro_batches";
  std::vector<int64_t> w(n);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    w[i] = workload_of(seqlens[i], workload, coef);
    total = checked::add(op, "the total of seqlens", total, seqlens[i]);
  }
  const int64_t k_start =
      checked::round_up(op, "the micro-batch count",
                        std::max(total / max_tokens + (total % max_tokens != 0), min_micro_batches), multiple_of);
  // No count below min_bins can meet the cap, so starting the scan at the first multiple above it gives the
  // same plan as scanning up from k_start, without the attempts that must fail.
  int64_t k =
      std::max(k_start, checked::round_up(op, "the micro-batch count", min_bins(seqlens, n, max_tokens), multiple_of));
  std::vector<int64_t> packed(n);
  const int64_t k_pack = pack_tokens(seqlens, n, max_tokens, packed.data());  // always meets the cap
  std::vector<int64_t> part(n);
  int64_t scan = 0, repair_work = 0;
  for (;;) {
    if (method == Method::KarmarkarKarp) karmarkar_karp(w.data(), n, k, /*equal_count=*/false, part.data());
    else first_fit_decreasing(w.data(), seqlens, n, k, max_tokens, part.data());
    Bins bins(k, max_tokens, w.data(), seqlens, workload, coef, n, part.data());
    bool ok = repair(bins, Kinds{true, true, false}, kRepairWork - repair_work);
    repair_work += bins.work;
    if (!ok && k >= k_pack) {  // the token packing meets the cap with this many micro-batches
      bins = Bins(k, max_tokens, w.data(), seqlens, workload, coef, n, packed.data());
      ok = true;
    }
    if (!ok) {
      scan += n + k;
      k = checked::add(op, "the micro-batch count", k, multiple_of);
      if (scan > kScanWork) k = std::max(k, checked::round_up(op, "the micro-batch count", k_pack, multiple_of));
      continue;
    }
    search(bins, n, /*moves=*/true, /*pairs=*/true);
    return to_partition(bins, order);
  }
}

Partition balance_across_ranks(const int64_t* seqlens, int64_t n, int64_t world_size, bool equal_count,
                               Workload workload, int64_t coef) {
  std::vector<int64_t> w(n);
  for (int64_t i = 0; i < n; ++i) w[i] = workload_of(seqlens[i], workload, coef);
  std::vector<int64_t> part(n);
  karmarkar_karp(w.data(), n, world_size, equal_count, part.data());
  Bins bins(world_size, /*cap=*/-1, w.data(), seqlens, workload, coef, n, part.data());
  search(bins, n, /*moves=*/!equal_count, /*pairs=*/false);
  return to_partition(bins, Order::AsPlanned);
}

}  // namespace packcuda::balance
