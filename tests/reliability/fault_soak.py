"""The fault soak through SMG: two `xserv engine`s behind `smg launch`, and an `xserv rest` front
straight to both, under a mixed load (streams, structured outputs, forced tool calls, n > 1,
streams cancelled mid-way, clients that vanish), while one engine is killed (SIGKILL) and
restarted, then the other drained (SIGTERM).

Shared by tests/reliability/test_fault_soak.py (bounded) and scripts/fault_soak.py (as long as
an operator likes). run_soak() returns a SoakReport; its problems() are what fails the soak:
a request that neither completed correctly nor ended with a clean OpenAI error, one past its
deadline, KV blocks held after the load, a process left behind, an engine's RSS grown > 10 %.
"""

import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.reliability.processes import RestProcess, alive, child_pids, rss_mb, stream_events
from tests.reliability.soak_report import SoakReport
from tests.scaleout.gateway import Gateway
from tests.server.engine_process import EngineProcess
from tests.support.processes import wait_http_ok

MODEL = "xserv-demo-qwen3-random"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                          "required": ["city"], "additionalProperties": False}}}]
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"],
         "additionalProperties": False}
CITIES = ({"city": "Paris"}, {"city": "Oslo"})
KINDS = ("stream", "json", "tool", "n2", "cancel", "vanish")
# SMG notices a dead or drained engine within seconds, not its default minute
SMG_HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2",
              "--health-success-threshold", "1")


@dataclass(frozen=True)
class SoakPlan:
    duration_s: float = 150.0  # of load, after the warm-up
    warmup_s: float = 20.0  # of the same load before RSS is first read (allocator caches fill)
    threads: int = 8
    seed: int = 20261203
    deadline_s: float = 60.0  # no request may take longer
    kill_at: float = 0.2  # fractions of duration_s: SIGKILL engine 0 (restarted at once) ...
    drain_at: float = 0.6  # ... then SIGTERM engine 1
    max_num_seqs: int = 4
    max_requests: int | None = None  # stop sending after this many


class Deployment:
    """Two engines (SMALL, --max-num-seqs), SMG over both, a REST front straight to both."""

    def __init__(self, plan: SoakPlan, logs: Path):
        self.logs = logs
        self.flags = ("--max-num-seqs", str(plan.max_num_seqs))
        self.engines = [EngineProcess(*self.flags, log_path=logs / f"engine{i}.log") for i in range(2)]
        self.names = {engine.proc.pid: f"engine{i}" for i, engine in enumerate(self.engines)}
        self.retired: list[EngineProcess] = []  # killed or drained: their pids must be gone at the end
        self.gateway = self.front = None
        self.front_pids: list[int] = []

    def start(self) -> None:
        for engine in self.engines:
            engine.wait_serving()
        self.gateway = Gateway([e.address for e in self.engines], *SMG_HEALTH, log_path=self.logs / "smg.log")
        self.front = RestProcess(",".join(e.address for e in self.engines), "--workers", "1", "--threads", "64")
        self.gateway.wait_ready(MODEL, workers=2)
        wait_http_ok(f"{self.front.url}/health", self.front.proc, 60)
        self.front_pids = [self.front.proc.pid, *child_pids(self.front.proc.pid)]

    @property
    def entry_points(self) -> dict[str, str]:
        return {"smg": self.gateway.url, "rest": self.front.url}

    def kill_and_restart(self, i: int) -> None:
        old = self.engines[i]
        old.proc.kill()
        old.proc.wait()
        old.stop()
        self.retired.append(old)
        self.engines[i] = EngineProcess(*self.flags, log_path=self.logs / f"engine{i}-restarted.log", port=old.port)
        self.names[self.engines[i].proc.pid] = f"engine{i}-restarted"
        self.engines[i].wait_serving()

    def name(self, engine: EngineProcess) -> str:
        return self.names[engine.proc.pid]

    def drain(self, i: int) -> int:
        engine = self.engines.pop(i)
        self.retired.append(engine)
        return engine.stop()  # SIGTERM, then wait for the drain to end

    def smg_healthy(self) -> dict[str, bool]:
        """Whether SMG routes to each engine now: the live ones, and the retired ones whose address
        no live engine took over."""
        workers = requests.get(f"{self.gateway.url}/workers", timeout=5).json()["workers"]
        healthy = {w["url"].removeprefix("grpc://"): w["is_healthy"] for w in workers}
        live = {e.address for e in self.engines}
        shown = [*self.engines, *(e for e in self.retired if e.address not in live)]
        return {self.name(e): healthy.get(e.address, False) for e in shown}

    def retried_by_smg(self) -> float:
        text = requests.get(self.gateway.metrics_url, timeout=5).text
        return sum(float(v) for v in re.findall(r"^smg_worker_retries_total(?:\{[^}]*\})? (\S+)$", text, re.M))

    def stop(self) -> list[int]:
        """Stop everything; the pids of whatever is still alive afterwards."""
        for part in (self.gateway, self.front, *self.engines):
            if part is not None:
                part.stop()
        pids = [e.proc.pid for e in (*self.engines, *self.retired)] + self.front_pids
        pids += [self.gateway.proc.pid] if self.gateway is not None else []
        time.sleep(0.5)
        return [pid for pid in pids if alive(pid)]


def one_request(url: str, kind: str, rng: random.Random, deadline_s: float) -> tuple[str, str]:
    """Send one request of this kind: (its outcome, what came back if it was bad). The outcome is
    completed_<kind>, cancelled or vanished (on purpose), clean_error_<status>_<code>, or bad_<why>."""
    body = ""
    try:
        outcome, body = _send(url, kind, rng, deadline_s)
    except requests.RequestException as exc:
        outcome = f"bad_{type(exc).__name__}"
    return outcome, body[:500] if outcome.startswith("bad") else ""


def _send(url: str, kind: str, rng: random.Random, deadline_s: float) -> tuple[str, str]:
    if kind in ("stream", "cancel"):
        outcome, events = _stream(url, rng, deadline_s, cut_after=rng.randint(1, 4) if kind == "cancel" else None)
        return (f"completed_{kind}" if outcome == "completed" else outcome), json.dumps(events[-3:])
    body, path = _body(kind, rng)
    try:
        response = requests.post(f"{url}{path}", json=body, timeout=(5, rng.uniform(0.05, 0.5) if kind == "vanish"
                                                                      else deadline_s))
    except requests.ReadTimeout:
        return ("vanished" if kind == "vanish" else "bad_deadline"), ""
    if response.status_code != 200:
        return _error_outcome(response.status_code, response.text), response.text
    if kind == "vanish":
        return "completed_vanish", ""  # answered before the client gave up
    try:
        correct = _correct(kind, response.json())
    except (ValueError, KeyError, TypeError):  # not JSON, or not the answer's shape
        correct = False
    return (f"completed_{kind}" if correct else f"bad_answer_{kind}"), response.text


def _body(kind: str, rng: random.Random) -> tuple[dict, str]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(("Hi", "Weather?", "Pick one"))}],
            **NO_THINKING}
    if kind == "json":
        return {**chat, "max_tokens": 24, "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "c", "schema": COLOR}}}, \
            "/v1/chat/completions"
    if kind == "tool":
        return {**chat, "max_tokens": 40, "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "/v1/chat/completions"
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": rng.randint(4, 24), "temperature": 0.8}
    return ({**body, "n": 2} if kind == "n2" else {**body, "max_tokens": 64}), "/v1/completions"


def _correct(kind: str, answer: dict) -> bool:
    choices = answer["choices"]
    if kind == "n2":
        return sorted(c["index"] for c in choices) == [0, 1] and all(c["finish_reason"] in ("length", "stop")
                                                                      for c in choices)
    message = choices[0].get("message", {})
    if kind == "json":
        return choices[0]["finish_reason"] == "length" or json.loads(message["content"])["color"] in ("red", "green")
    if kind == "tool":  # one call or more (parallel calls), each complete unless cut by max_tokens
        calls = message["tool_calls"]
        return bool(calls) and (choices[0]["finish_reason"] == "length" or all(
            c["function"]["name"] == "get_weather" and json.loads(c["function"]["arguments"]) in CITIES for c in calls))
    return choices[0]["finish_reason"] in ("length", "stop")


def _stream(url: str, rng: random.Random, deadline_s: float, cut_after: int | None) -> tuple[str, list]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "stream": True,
            "max_tokens": rng.randint(8, 32), **NO_THINKING}
    started = time.monotonic()
    events = []
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=(5, deadline_s)) as response:
        if response.status_code != 200:
            return _error_outcome(response.status_code, response.text), [response.text]
        for event in stream_events(response):
            events.append(event)
            if isinstance(event, dict) and "error" in event:
                return _error_outcome(200, json.dumps(event)), events
            if cut_after is not None and len(events) >= cut_after:
                return "cancelled", events  # leaving the `with` closes the connection mid-stream
            if time.monotonic() - started > deadline_s:
                return "bad_deadline", events
    if not events or events[-1] != "[DONE]":
        return "bad_stream_cut_without_error", events
    reasons = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")]
    return ("completed" if reasons in (["length"], ["stop"]) else "bad_answer_stream"), events


def _error_outcome(status: int, text: str) -> str:
    """clean_error_<status>_<code> for an OpenAI error body or event; bad_error_<status> otherwise."""
    try:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"bad_error_{status}"
    return f"clean_error_{status}_{error.get('code') or error.get('type')}"


def run_soak(plan: SoakPlan, logs: Path) -> SoakReport:
    report = SoakReport()
    deployment = Deployment(plan, logs)
    try:
        deployment.start()
        _load(deployment, plan, report)
        report.retried_by_smg = deployment.retried_by_smg()
        report.smg_healthy = deployment.smg_healthy()
        for engine in deployment.engines:
            info = engine.wait_all_blocks_free(timeout=10)
            report.kv_blocks[deployment.name(engine)] = (info.kv_blocks_free, info.kv_blocks_total, info.num_running)
            report.rss_end_mb[deployment.name(engine)] = round(rss_mb(engine.proc.pid))
    finally:
        report.left_behind = deployment.stop()
    return report


def _load(deployment: Deployment, plan: SoakPlan, report: SoakReport) -> None:
    """The mixed load for warmup_s + duration_s on both entry points, the faults meanwhile."""
    lock, stop = threading.Lock(), threading.Event()
    sent = [0]
    began = time.monotonic()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            with lock:
                if plan.max_requests is not None and sent[0] >= plan.max_requests:
                    return
                sent[0] += 1
            via, kind = rng.choice(sorted(deployment.entry_points)), rng.choice(KINDS)
            started = time.monotonic()
            outcome, body = one_request(deployment.entry_points[via], kind, rng, plan.deadline_s)
            with lock:
                report.outcomes[outcome] += 1
                report.slowest_s = max(report.slowest_s, time.monotonic() - started)
                if outcome.startswith("bad") and len(report.failures) < 20:
                    report.failures.append(f"{kind} via {via} at {time.monotonic() - began:.0f}s: {outcome}: {body}")

    with ThreadPoolExecutor(plan.threads) as pool:
        futures = [pool.submit(worker, plan.seed + i) for i in range(plan.threads)]
        try:
            _faults(deployment, plan, report)
        finally:
            stop.set()
        for future in futures:
            future.result(timeout=plan.deadline_s + 30)


def _faults(deployment: Deployment, plan: SoakPlan, report: SoakReport) -> None:
    """Warm up, read each engine's RSS; kill engine 0 and restart it (its RSS read after its own
    warm-up under the load); drain engine 1; run to the end."""
    began = time.monotonic()

    def at(seconds: float) -> None:
        time.sleep(max(0.0, began + seconds - time.monotonic()))

    def note(event: str) -> None:
        report.events.append(f"{time.monotonic() - began:.0f}s {event}")

    at(plan.warmup_s)
    for engine in deployment.engines:
        report.rss_warm_mb[deployment.name(engine)] = round(rss_mb(engine.proc.pid))
    at(plan.warmup_s + plan.kill_at * plan.duration_s)
    note("SIGKILL engine0")
    deployment.kill_and_restart(0)
    note("engine0 restarted, SERVING")
    restarted = deployment.engines[0]
    at(time.monotonic() - began + plan.warmup_s)
    report.rss_warm_mb[deployment.name(restarted)] = round(rss_mb(restarted.proc.pid))
    at(plan.warmup_s + plan.drain_at * plan.duration_s)
    note("SIGTERM engine1")
    code = deployment.drain(1)
    note(f"engine1 drained, exit {code}")
    at(plan.warmup_s + plan.duration_s)
