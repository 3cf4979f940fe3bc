"""``python -m hf_pipeline.cli``: what the launcher's processes run."""

import sys

from . import main

sys.exit(main())
