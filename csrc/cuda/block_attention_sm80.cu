// block_attention compiled for sm80 only (setup.py reads the arch from the file name).
#define DFLASH_ARCH_NS sm80
#define DFLASH_USE_WGMMA 0
#include "dflash/cuda/block_attention.cuh"
