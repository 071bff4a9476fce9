"""`import mhsa.positional` and `from mhsa.positional import ...`: this name is the module
mhsa.nn.positional itself, one module object under two names (as os.path is posixpath)."""

import sys

from .nn import positional as _module

sys.modules[__name__] = _module
