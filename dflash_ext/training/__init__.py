"""DFlash drafter training: target-regenerated data, cached target features, the
block-sparse anchor recipe, and a (data-parallel) trainer."""
