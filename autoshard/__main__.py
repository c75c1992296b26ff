"""``python -m autoshard check ...``: see :mod:`autoshard.adapters.cli`."""

import sys

from autoshard.adapters.cli import main

sys.exit(main())
