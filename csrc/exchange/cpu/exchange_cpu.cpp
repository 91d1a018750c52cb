// CPU kernel of the exchange's unpack step (gather_sum): loops over rows and elements calling the shared math
// of exchange_math.h.
#include <cstring>

#include "common/dispatch.h"
#include "exchange/exchange.h"
#include "exchange/exchange_math.h"

namespace packcuda::exchange {

void gather_sum_cpu(const GatherSum& g) {
  if (g.n_out == 0 || g.C == 0) return;
  if (g.M == 1) {  // a copy of each row's bytes
    const int64_t rb = g.C * g.elem_size;
    const char* a = static_cast<const char*>(g.a);
    const char* b = static_cast<const char*>(g.b);
    char* out = static_cast<char*>(g.out);
    for (int64_t r = 0; r < g.n_out; ++r) {
      const int64_t i = g.index[r];
      if (i < 0) std::memset(out + r * rb, 0, rb);
      else std::memcpy(out + r * rb, i < g.na ? a + i * rb : b + (i - g.na) * rb, rb);
    }
    return;
  }
  dispatch_dtype(g.dtype, [&](auto tag) {
    using S = decltype(tag);
    for (int64_t r = 0; r < g.n_out; ++r)
      for (int64_t c = 0; c < g.C; ++c)
        gather_sum_elem<S>(static_cast<S*>(g.out), static_cast<const S*>(g.a), g.na, static_cast<const S*>(g.b),
                           g.index, g.M, g.C, r, c);
  });
}

}  // namespace packcuda::exchange
