"""``python -m metaopt.launch`` == ``metaoptrun``."""

import sys

from metaopt.launch import main

sys.exit(main())
