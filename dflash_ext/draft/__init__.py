"""Drafting at inference: the drafter's context cache (:mod:`.cache`), its layers on the fused
ops and the stacked weights they read (:mod:`.layers`), the target's parts a draft step runs
(:mod:`.head`), CUDA graphs (:mod:`.graphs`), and the one draft runtime that holds a
generation's state and runs the draft step (:mod:`.runtime`), which the proposer of
``spec_generate`` (:mod:`.proposer`) and the Hugging Face assistant (:mod:`.assistant`) wrap.
Imports only :mod:`dflash_ext.ops` and :mod:`dflash_ext.model`."""
