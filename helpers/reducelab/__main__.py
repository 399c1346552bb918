"""``python -m reducelab``: the ``reducelab`` command (see :mod:`reducelab.cli`)."""
import sys

from .cli import main

sys.exit(main())
