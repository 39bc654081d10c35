"""The command line, ``python -m dflash_ext`` (:mod:`dflash_ext.__main__` calls
:func:`dflash_ext.cli.main.main`): args (typed arguments, usage errors), demo (what generate
runs: the target alone timed, the dtype, DFlash's runs, the baseline), generate (generate's
arguments, info), training (gen-data, train, eval, export), main (the parser)."""
