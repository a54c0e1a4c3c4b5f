"""``python -m trl_mdi.profile``: the per-layer attention profile of one or more checkpoints (see `trl_mdi.profile`)."""

import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
