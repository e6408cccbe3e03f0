"""Where xserv keeps what it builds once per machine: $XDG_CACHE_HOME/xserv, else ~/.cache/xserv
(the demo checkpoint, the CPU decode kernel)."""

import os
from pathlib import Path


def user_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "xserv"
