// Checked arithmetic for host sizes (cu_seqlens totals, padded lengths, buffer sizes): an overflow is a
// std::invalid_argument naming the op and the quantity (a ValueError in Python), never a wrapped value.
#pragma once
#include <cstdint>

#include "errors.h"

namespace packcuda::checked {

// a + b, a * b, a - b in int64; `op` and `what` name the call and the quantity in the error.
inline int64_t add(const char* op, const char* what, int64_t a, int64_t b) {
  int64_t r;
  PC_CHECK(!__builtin_add_overflow(a, b, &r), "packcuda.", op, ": ", what, " overflows int64 (", a, " + ", b, ")");
  return r;
}
inline int64_t sub(const char* op, const char* what, int64_t a, int64_t b) {
  int64_t r;
  PC_CHECK(!__builtin_sub_overflow(a, b, &r), "packcuda.", op, ": ", what, " overflows int64 (", a, " - ", b, ")");
  return r;
}
inline int64_t mul(const char* op, const char* what, int64_t a, int64_t b) {
  int64_t r;
  PC_CHECK(!__builtin_mul_overflow(a, b, &r), "packcuda.", op, ": ", what, " overflows int64 (", a, " * ", b, ")");
  return r;
}
// ceil(a / m) * m for a >= 0, m >= 1, checked.
inline int64_t round_up(const char* op, const char* what, int64_t a, int64_t m) {
  PC_CHECK(a >= 0 && m >= 1, "packcuda.", op, ": ", what, " needs a >= 0 and a multiple >= 1, got ", a, " and ", m);
  const int64_t q = a / m + (a % m != 0);
  return mul(op, what, q, m);
}

}  // namespace packcuda::checked
