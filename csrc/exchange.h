// packcuda C++ core, the plan-driven row exchange between CP ranks (torch-free; link packcuda::core).
// Consumers write #include <packcuda/exchange.h>.
#pragma once
#include "exchange/exchange.h"
#include "exchange/exchange_static.h"
