"""`import mhsa.scores` and `from mhsa.scores import ...`: this name is the module
mhsa.core.scores itself, one module object under two names (as os.path is posixpath)."""

import sys

from .core import scores as _module

sys.modules[__name__] = _module
