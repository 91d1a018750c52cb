// packcuda C++ core, varlen causal conv1d and the moves of the conv-prefix exchange (torch-free; link
// packcuda::core).
// Consumers write #include <packcuda/conv.h>.
#pragma once
#include "conv/conv.h"
