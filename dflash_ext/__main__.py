"""``python -m dflash_ext``: the command line, :mod:`dflash_ext.cli` (the parser:
:func:`dflash_ext.cli.main.main`). The names it held before the CLI became a package stay
importable from here."""
from .cli.args import (UsageError, _checked, drafter_folder, drafter_init, existing_dir,  # noqa: F401
                       int_from_2, nonnegative_float, nonnegative_int, output_dir, output_file, parse_block_size,
                       positive_float, positive_int, probability, seed_int, target_name, torch_device)
from .cli.generate import cmd_generate, cmd_info  # noqa: F401
from .cli.main import main
from .cli.training import cmd_eval, cmd_export, cmd_gen_data, cmd_train, resolve_dtype, train_run_config  # noqa: F401
from .timing import fastest_target_alone, time_target_alone  # noqa: F401

if __name__ == "__main__":
    main()
