"""How the engine's OpenMP threads wait for work: set in the environment before torch loads.

torch's CPU kernels run on an OpenMP team (GNU libgomp). Between parallel regions libgomp's
threads spin, by default for 300,000 rounds, before they sleep. An engine never has the cores to
itself: its gRPC loop, the REST front, the clients and, on a shared host, other jobs run beside
it. A spinning thread then holds a core that one of those wants, and a team member that loses
its core stalls every region until it gets one back. GOMP_SPINCOUNT=10000 spins long enough to
catch the next op of a step on a quiet machine (as fast as the default there) and sleeps soon
enough to give the core back on a busy one. The measurements are in docs/benchmarks-log.md ("How
the engine's threads wait").

Importing this module does not import torch. A setting the user made (OMP_WAIT_POLICY or
GOMP_SPINCOUNT) is kept.
"""

import os
import sys

SPIN_COUNT = "10000"


def wait_briefly() -> bool:
    """Set GOMP_SPINCOUNT for this process before torch loads; True if it was set here."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return False
    if "torch" in sys.modules:  # libgomp read its environment when torch loaded it: too late
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
