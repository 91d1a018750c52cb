// packcuda C++ core, packing: remove/restore padding, positions, next-token labels, bucket padding (torch-free; link
// packcuda::core). Consumers write #include <packcuda/pack.h>.
#pragma once
#include "pack/pack.h"
