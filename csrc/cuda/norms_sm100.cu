// rms_norm / add_rms_norm / qk_norm_rope compiled for sm100 only (setup.py reads the arch from the file name).
#define DFLASH_ARCH_NS sm100
#include "dflash/cuda/norms.cuh"
