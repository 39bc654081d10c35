"""The benchmarks of dflash_ext, each a module run from the repository root as
``python -m bench.<name>`` (bench_ops, draft_latency, e2e, verify_numerics, malloc_reuse;
the training experiments in bench.training: learning_curve, train_profile). _common holds
what they share; the random op inputs are dflash_ext.testing's. Figures: bench/RESULTS.md;
raw outputs: bench/results/."""
