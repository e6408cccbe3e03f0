"""The fault soak through SMG, as long as you like (tests/reliability/test_fault_soak.py runs a
bounded one): two `xserv engine`s on the demo model behind `smg launch`, an `xserv rest` front
straight to both, a mixed load on both entry points, one engine SIGKILLed and restarted, the other
drained. Prints the counts and exits 0 if every check passed (tests/reliability/fault_soak.py).

    .venv/bin/python scripts/fault_soak.py --duration 1800 --threads 16

Needs the test extras (smg, requests): pip install -e '.[test]'.
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the tests' process helpers, as pytest finds them

from tests.reliability.fault_soak import SoakPlan, run_soak  # noqa: E402

DEFAULTS = SoakPlan()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=DEFAULTS.duration_s, help="seconds of load after the warm-up")
    parser.add_argument("--warmup", type=float, default=DEFAULTS.warmup_s,
                        help="seconds of load before each engine's RSS is first read")
    parser.add_argument("--threads", type=int, default=DEFAULTS.threads, help="clients sending at once")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--deadline", type=float, default=DEFAULTS.deadline_s, help="seconds any request may take")
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs, help="each engine's batch")
    parser.add_argument("--max-requests", type=int, default=None, help="stop sending after this many")
    parser.add_argument("--logs", type=Path, default=None, help="directory for the processes' logs (default: a temp one)")
    args = parser.parse_args()
    plan = SoakPlan(duration_s=args.duration, warmup_s=args.warmup, threads=args.threads, seed=args.seed,
                    deadline_s=args.deadline, max_num_seqs=args.max_num_seqs, max_requests=args.max_requests)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="xserv-fault-soak-"))
    logs.mkdir(parents=True, exist_ok=True)
    report = run_soak(plan, logs)
    print(report.summary())
    for failure in report.failures:
        print("  failed:", failure)
    problems = report.problems(plan.deadline_s)
    print("PASS" if not problems else "FAIL: " + "; ".join(problems), f"(logs in {logs})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
