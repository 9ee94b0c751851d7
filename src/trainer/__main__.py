"""``python -m trainer``: the same commands as the ``trainer`` console script."""

import sys

from trainer.cli import main

sys.exit(main(prog="python -m trainer"))
