// packcuda C++ core, mRoPE position ids (torch-free; link packcuda::core). Consumers write
// #include <packcuda/mrope.h>.
#pragma once
#include "mrope/mrope_pos.h"
