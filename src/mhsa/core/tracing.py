"""What the engines tell torch.compile, without importing torch._dynamo at import time.

`torch.compiler.assume_constant_result` imports torch._dynamo, which takes seconds;
decorating at import time made `import mhsa` (and so `mhsa --help`) pay that cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def constant_when_traced(fn: F) -> F:
    """Mark fn as `torch.compiler.assume_constant_result` does: a traced graph calls it
    once, eagerly, and keeps its result as a constant. The mark is the one torch's
    decorator sets (tests/core/test_tracing.py compares them), read by dynamo only
    when it traces."""
    fn._dynamo_marked_constant = True
    return fn
