"""`python -m mhsa.cli` (and `torchrun -m mhsa.cli`): the `mhsa` command."""

import sys

from . import main

sys.exit(main())
