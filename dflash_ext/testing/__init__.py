"""What the tests, the benchmarks and the GPU tools share (as ``flashinfer.testing`` is for
FlashInfer): :mod:`.inputs` (random inputs of every op), :mod:`.targets` (tiny random
Hugging Face targets of every model family) and :mod:`.oracle` (a proposer that knows the
answer). Nothing of the package's other layers imports it."""
