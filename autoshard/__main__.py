"""``python -m autoshard check ...``: see :mod:`autoshard.cli`."""

import sys

from autoshard.cli import main

sys.exit(main())
