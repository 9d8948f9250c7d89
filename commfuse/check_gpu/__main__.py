"""``python -m commfuse.check_gpu``: the same as ``commfuse check-gpu``."""

import sys

from commfuse.check_gpu import main

sys.exit(main())
