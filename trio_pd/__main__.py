"""``python -m trio_pd``: the ``trio-pd`` command line."""

import sys

from .cli import main

sys.exit(main())
