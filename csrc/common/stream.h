// cudaStream_t without pulling in the CUDA headers (the same typedef the CUDA runtime uses), so the core
// API headers compile in CPU-only consumers too.
#pragma once
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;
