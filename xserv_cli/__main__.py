"""python -m xserv_cli: the `xserv` command (the tests and `xserv up` start processes this way)."""

import sys

from xserv_cli.main import main

sys.exit(main())
