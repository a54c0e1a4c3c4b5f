"""``python -m trl_mdi.tiny``: build and save a tiny VLM (see `trl_mdi.tiny.main`)."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
