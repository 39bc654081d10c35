"""Decoding: the target's side (:mod:`.runner`: one forward as the loop calls it, the static
cache, compiled passes; :mod:`.rollback`: its cache after a rejection), the verify rule
(:mod:`.verify`), one step (:mod:`.step`: draft -> verify -> accept -> roll back -> inject),
the block size timed at run time (:mod:`.autotune`) and the loops (:mod:`.loop`: ``spec_generate``,
``target_generate``). Imports only the layers below it (ops, model, draft)."""
