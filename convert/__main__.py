"""`python -m convert SRC OUT [--dtype ...]`, the same as the `qspec-convert` command."""

import sys

from convert.cli import main

sys.exit(main())
