"""Kernel tests run on CPU under Triton's interpreter.

The interpreter is chosen when a kernel is decorated (module import), so the
variable must be set before ``kvfleet.engine.kernels`` is first imported.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
