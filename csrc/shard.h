// packcuda C++ core, shard plans for context parallelism (torch-free; link packcuda::core).
// Consumers write #include <packcuda/shard.h>.
#pragma once
#include "shard/shard.h"
