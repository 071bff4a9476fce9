"""`import mhsa.masks` and `from mhsa.masks import ...`: this name is the module
mhsa.core.masks itself, one module object under two names (as os.path is posixpath)."""

import sys

from .core import masks as _module

sys.modules[__name__] = _module
