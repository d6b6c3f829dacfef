"""`python -m dstune ...` is the `dstune` command."""

import sys

from dstune.cli import main

sys.exit(main())
