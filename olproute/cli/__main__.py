"""``python -m olproute.cli``: the same as ``olproute``."""

import sys

from olproute.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
