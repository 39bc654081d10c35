// block_conv compiled for sm90a only (setup.py reads the arch from the file name).
#define DFLASH_ARCH_NS sm90a
#include "dflash/cuda/block_conv.cuh"
