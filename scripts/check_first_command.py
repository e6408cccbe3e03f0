"""CI stage: run the README's FIRST command as a new user would, then talk to what it started.

Takes the command from README.md itself (the bash block under "Start xserv on the demo model"),
runs it in a copy of the checkout (so its `.venv` is new and holds exactly what the command
installs, no extras) with an empty XDG cache (so the demo model is built as on a first run),
waits for /health, sends the banner's own "try:" request plain and streamed, presses Ctrl-C
(SIGINT to the command's process group) and checks that every process it started has exited.

Standard library only: it runs before any venv exists. Exit code 0 on success.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Start xserv on the demo model"
REST = "http://127.0.0.1:8000"
START_TIMEOUT_S = 1800  # venv + pip install + demo model build + load + warm-up
REQUEST_TIMEOUT_S = 120
STOP_TIMEOUT_S = 90


def readme_command() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(SECTION, 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    if block is None:
        sys.exit(f"README.md: no ```bash block under {SECTION!r}")
    return block.group(1).strip()


def copy_checkout(dest: Path) -> None:
    """Tracked and untracked-but-not-ignored files: what a clone of this tree would hold."""
    listing = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                             check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listing):
        source, target = ROOT / name, dest / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
            target.chmod(source.stat().st_mode)


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def http(path: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(REST + path, data=data, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def wait_healthy(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(f"the command exited with code {proc.returncode} before serving", log)
        try:
            with http("/health", timeout=2) as resp:
                if resp.status == 200 and "try: curl" in log.read_text(errors="replace"):
                    return
        except OSError:
            pass
        time.sleep(2)
    fail(f"not healthy after {START_TIMEOUT_S} s", log)


def banner_body(log: Path) -> dict:
    """The JSON body of the banner's "try:" curl line: the first request a new user sends."""
    line = next(l for l in log.read_text(errors="replace").splitlines() if "try: curl" in l)
    words = shlex.split(line.split("try:", 1)[1])
    return json.loads(words[words.index("-d") + 1])


def check_requests(body: dict) -> None:
    started = time.monotonic()
    with http("/v1/chat/completions", body) as resp:
        answer = json.load(resp)
    plain_s = time.monotonic() - started
    choice = answer["choices"][0]
    assert choice["finish_reason"] in ("stop", "length"), answer
    assert isinstance(choice["message"]["content"], str), answer
    print(f"first-command: plain chat completion, {answer['usage']['completion_tokens']} tokens "
          f"({choice['finish_reason']}) in {plain_s:.1f} s", flush=True)

    started, deltas, finish, done = time.monotonic(), 0, None, False
    with http("/v1/chat/completions", {**body, "stream": True}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream"), resp.headers
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                deltas += bool(c["delta"].get("content") or c["delta"].get("reasoning_content"))
                finish = c.get("finish_reason") or finish
    assert done and finish in ("stop", "length") and deltas > 0, (done, finish, deltas)
    print(f"first-command: streamed chat completion, {deltas} deltas ({finish}) in "
          f"{time.monotonic() - started:.1f} s", flush=True)


def check_chat_page() -> None:
    """What the README's first section promises a browser at the front's address: the chat page,
    under its Content-Security-Policy, and the files it loads."""
    with http("/") as resp:
        page = resp.read().decode()
        assert resp.headers["Content-Type"].startswith("text/html"), resp.headers
        assert "script-src 'self'" in resp.headers["Content-Security-Policy"], resp.headers
    files = re.findall(r'(?:src|href)="(/web/[^"]+)"', page)
    for path in files:
        with http(path) as resp:
            assert resp.status == 200 and resp.read(), path
    print(f"first-command: chat page at / and its {len(files)} files", flush=True)


def stop_with_ctrl_c(proc: subprocess.Popen, log: Path) -> None:
    started = descendants(proc.pid) | {proc.pid}
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the foreground group
    try:
        code = proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        fail(f"still running {STOP_TIMEOUT_S} s after Ctrl-C", log)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in started):
        time.sleep(0.2)
    left = sorted(pid for pid in started if alive(pid))
    if left:
        fail(f"processes left after Ctrl-C: {left}", log)
    if code != 0:
        fail(f"exit code {code} after Ctrl-C", log)
    print(f"first-command: Ctrl-C stopped all {len(started)} processes, exit code 0", flush=True)


def fail(message: str, log: Path) -> None:
    tail = log.read_text(errors="replace")[-6000:] if log.exists() else ""
    sys.exit(f"first-command FAILED: {message}\n--- output (tail) ---\n{tail}")


def main() -> int:
    command = readme_command()
    with tempfile.TemporaryDirectory(prefix="xserv-first-") as tmp:
        checkout, cache, log = Path(tmp) / "xserv", Path(tmp) / "cache", Path(tmp) / "output.log"
        copy_checkout(checkout)
        cache.mkdir()
        # An empty XDG cache: the demo model is built as on a first run. pip keeps its own download
        # cache, which changes how fast packages arrive, never which ones are installed.
        env = {**os.environ, "XDG_CACHE_HOME": str(cache),
               "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))}
        env.pop("VIRTUAL_ENV", None)
        print(f"first-command: {command}", flush=True)
        with log.open("wb") as out:
            proc = subprocess.Popen(["bash", "-c", command], cwd=checkout, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_healthy(proc, log)
            check_requests(banner_body(log))
            check_chat_page()
            stop_with_ctrl_c(proc, log)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
