"""``python -m dflash_ext``: the command line (:func:`dflash_ext.cli.main.main`)."""
from .cli.main import main

if __name__ == "__main__":
    main()
