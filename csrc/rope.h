// packcuda C++ core, fused rotary application (torch-free; link packcuda::core). Consumers write
// #include <packcuda/rope.h>.
#pragma once
#include "rope/rope_apply.h"
