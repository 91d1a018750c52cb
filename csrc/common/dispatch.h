// The one dispatch vocabulary of the kernels (host side, CPU and CUDA): a run-time value becomes a compile-time
// one by calling f with a tag, so a kernel is written once as a template.
//   dispatch_dtype(t, f)            f(float{} | double{} | bf16_t{} | f16_t{}): the storage type of t (dtype.h)
//   dispatch_bool(b, f)             f(std::true_type{} | std::false_type{})
//   dispatch_first<V...>(pred, f)   f(std::integral_constant<int, V>{}) for the first V with pred(V), else the
//                                   last V (a widest-vector cascade, a kernel-size bucket)
//   dispatch_one_of<V...>(v, f)     f(std::integral_constant<int, V>{}) for the V equal to v; returns whether
//                                   there was one (false: none, f not called; a shape with specialized kernels)
#pragma once
#include <stdexcept>
#include <type_traits>

#include "dtype.h"

namespace packcuda {

template <typename F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F64: f(double{}); break;
    case DType::BF16: f(bf16_t{}); break;
    case DType::F16: f(f16_t{}); break;
    default: throw std::invalid_argument("packcuda: unsupported element type");
  }
}

template <typename F>
void dispatch_bool(bool b, F&& f) {
  if (b) f(std::true_type{});
  else f(std::false_type{});
}

template <int V, int... Rest, typename P, typename F>
void dispatch_first(P&& pred, F&& f) {
  if constexpr (sizeof...(Rest) == 0) {
    f(std::integral_constant<int, V>{});
  } else {
    if (pred(V)) f(std::integral_constant<int, V>{});
    else dispatch_first<Rest...>(pred, f);
  }
}

template <int... Vs, typename I, typename F>
bool dispatch_one_of(I v, F&& f) {
  return ((v == Vs ? (static_cast<void>(f(std::integral_constant<int, Vs>{})), true) : false) || ...);
}

}  // namespace packcuda
