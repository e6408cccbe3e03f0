"""`xserv engine` lets its OpenMP threads spin only briefly (GOMP_SPINCOUNT) unless the user chose
a wait policy, and sets it before torch (and so libgomp) loads, or it would have no effect."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.processes import REPO

# Runs the real `xserv engine` entry with serve() replaced by a probe that reports what the
# process looked like when the engine was about to be loaded.
PROBE = """
import json, os, sys
import xserv_engine.server.serve as serve_module

async def probe(*args, **kwargs):
    print(json.dumps({"spin": os.environ.get("GOMP_SPINCOUNT"), "torch_loaded": "torch" in sys.modules}))
    return 0

serve_module.serve = probe
from xserv_cli.main import main
sys.exit(main(["engine", "--port", "0"]))
"""


def engine_environment(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**clean, **env},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_engine_sets_a_short_spin_before_torch_loads():
    seen = engine_environment()
    assert seen == {"spin": "10000", "torch_loaded": False}


@pytest.mark.parametrize("env", [{"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_a_users_wait_policy_is_kept(env):
    seen = engine_environment(**env)
    assert seen["spin"] == env.get("GOMP_SPINCOUNT")
