"""``python -m devtools.device_check [options]``, or ``torchrun ... -m devtools.device_check``: see the package."""

import sys

from devtools.device_check.run import main

if __name__ == "__main__":
    sys.exit(main())
