"""``python -m optpipe.cli``: the same as the ``optpipe`` script."""

import sys

from .main import main

sys.exit(main())
