// rms_norm / add_rms_norm / qk_norm_rope compiled for sm90a only (setup.py reads the arch from the file name).
#define DFLASH_ARCH_NS sm90a
#include "dflash/cuda/norms.cuh"
