// packcuda C++ core, micro-batch balancing under a token cap (torch-free; link packcuda::core).
// Consumers write #include <packcuda/balance.h>.
#pragma once
#include "balance/balance.h"
