// packcuda C++ core, the layout bridge between shard plan layouts (torch-free; link packcuda::core).
// Consumers write #include <packcuda/relayout.h>.
#pragma once
#include "relayout/relayout.h"
