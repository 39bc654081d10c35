"""Training experiments: ``python -m bench.training.learning_curve`` (held-out tau of a run
against the slot-tokens trained on) and ``python -m bench.training.train_profile`` (where a
CPU training step goes, under torch.profiler)."""
