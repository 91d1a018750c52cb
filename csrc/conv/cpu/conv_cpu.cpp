// CPU kernels of the causal conv1d: loops over (token tile, channel) calling
// the shared per-tile math of conv_math.h.
#include <stdexcept>
#include <type_traits>

#include "conv/conv.h"
#include "conv/conv_math.h"
#include "conv/conv_dispatch.h"

namespace packcuda::conv {
namespace {

using detail::dispatch_dtype;
using detail::dispatch_k;
using detail::shape_of;

constexpr int64_t kCpuTile = 128;

}  // namespace

int64_t conv_bwd_tiles_cpu(int64_t T) { return make_tiles(T, ceil_div(T, kCpuTile)).count; }

void causal_conv1d_fwd_cpu(const ConvArgs& a, void* y) {
  const ConvShape sh = shape_of(a);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using S = decltype(tag);
    const DensePrefix<S> pf{static_cast<const S*>(a.prefix), a.C, a.K - 1};
    dispatch_k(a.K, [&](auto km) {
      constexpr int KM = decltype(km)::value;
      for (int64_t t0 = 0; t0 < a.T; t0 += kCpuTile) {
        const int64_t t1 = t0 + kCpuTile < a.T ? t0 + kCpuTile : a.T;
        const int64_t s0 = find_segment(a.cu, a.nseg, t0);
        for (int64_t c = 0; c < a.C; ++c)
          conv_fwd_tile<S, KM>(
              DenseRows<S>{static_cast<const S*>(a.x), a.C},
              ConvTaps<S, KM, 1>(static_cast<const S*>(a.weight), static_cast<const S*>(a.bias), a.K, KM - a.K, c), pf,
              a.cu, sh, static_cast<S*>(y), c, t0, t1, s0);
      }
    });
  });
}

void causal_conv1d_bwd_cpu(const ConvArgs& a, const void* dy, void* dx, void* dweight, void* dbias, void* dprefix,
                           void* work, int64_t tiles) {
  const ConvShape sh = shape_of(a);
  const Tiles tl = make_tiles(a.T, tiles);
  if (tl.count != tiles && a.T > 0) throw std::invalid_argument("packcuda conv: inconsistent tile count");
  dispatch_dtype(a.dtype, [&](auto tag) {
    using S = decltype(tag);
    using A = typename Acc<S>::type;
    A* part = static_cast<A*>(work);
    const DensePrefix<S> pf{static_cast<const S*>(a.prefix), a.C, a.K - 1};
    if (dprefix)  // empty segments keep a zero prefix gradient
      for (int64_t i = 0; i < a.nseg * (a.K - 1) * a.C; ++i) static_cast<S*>(dprefix)[i] = from_acc<S>(A(0));
    dispatch_k(a.K, [&](auto km) {
      constexpr int KM = decltype(km)::value;
      for (int64_t i = 0; i < tl.count && a.T > 0; ++i) {
        const int64_t t0 = i * tl.len, t1 = t0 + tl.len < a.T ? t0 + tl.len : a.T;
        const int64_t s1 = find_segment(a.cu, a.nseg, t1 - 1);
        for (int64_t c = 0; c < a.C; ++c) {
          A dw[1][KM], db[1];
          conv_zero_partials(dw, db);
          conv_bwd_tile<S, KM>(
              DenseRows<S>{static_cast<const S*>(dy), a.C}, DenseRows<S>{static_cast<const S*>(a.x), a.C},
              ConvTaps<S, KM, 1>(static_cast<const S*>(a.weight), static_cast<const S*>(a.bias), a.K, KM - a.K, c), pf,
              a.cu, sh, static_cast<S*>(dx), static_cast<S*>(dprefix), c, t0, t1, s1, dw, db);
          conv_store_partials(dw, db, a.K, part + (i * a.C + c) * (a.K + 1));
        }
      }
    });
    const int64_t n = a.T > 0 ? tl.count : 0;
    for (int64_t c = 0; c < a.C; ++c)
      conv_reduce_channel<S>(part, n, sh, static_cast<S*>(dweight), static_cast<S*>(dbias), c);
  });
}

}  // namespace packcuda::conv
