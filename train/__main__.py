"""python -m train --config FILE [key=value ...]: the same as k3jax-train."""

import sys

from train.cli import main

sys.exit(main())
