// inject_context_kv compiled for sm90a only (setup.py reads the arch from the file name).
#define DFLASH_ARCH_NS sm90a
#define DFLASH_USE_WGMMA 1
#include "dflash/cuda/inject_context_kv.cuh"
