// inject_context_kv compiled for sm100 only (setup.py reads the arch from the file name).
#define DFLASH_ARCH_NS sm100
#define DFLASH_USE_WGMMA 0
#include "dflash/cuda/inject_context_kv.cuh"
