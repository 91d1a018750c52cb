// packcuda C++ core, mRoPE position ids and fused rotary (torch-free; link packcuda::core). Consumers write
// #include <packcuda/rope.h>.
#pragma once
#include "rope/mrope_pos.h"
#include "rope/rope_apply.h"
