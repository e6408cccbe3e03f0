"""Starts the SGLang Model Gateway (`smg launch`, PyPI `smg`) in gRPC mode in front of real
engines on loopback, and waits until it routes to all of them."""

import subprocess
import sys
import time
from pathlib import Path

import requests

from tests.support.processes import free_port, stop_process

SMG = str(Path(sys.executable).parent / "smg")
# cache_aware alone decides in these tests: no warm-up slice sends cache misses or hits to a
# worker whose cache is thin (both are on by default and would move requests at random).
CACHE_AWARE = ("--policy", "cache_aware", "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0")


class Gateway:
    def __init__(self, engine_addresses: list[str], *flags: str, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        metrics_port = free_port()  # its default (29000) would clash between gateways
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        command = [SMG, "launch", "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(metrics_port),
                   "--worker-urls", *[f"grpc://{address}" for address in engine_addresses],
                   "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen", "--log-level", "info", *flags]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, model_id: str, workers: int, timeout: float = 60) -> None:
        """Until the model is listed, every worker is healthy and the model's tokenizer is loaded
        (engines must be SERVING first: a worker that answers GetModelInfo with UNAVAILABLE is
        registered as model "unknown")."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}: {self.log_text()}")
            try:
                models = requests.get(f"{self.url}/v1/models", timeout=2).json()["data"]
                listed = requests.get(f"{self.url}/workers", timeout=2).json()["workers"]
                healthy = [w for w in listed if w["is_healthy"] and w["model_id"] == model_id]
                tokenizers = requests.get(f"{self.url}/v1/tokenizers", timeout=2).json()["tokenizers"]
                if ([m["id"] for m in models] == [model_id] and len(healthy) == workers
                        and model_id in [t["name"] for t in tokenizers]):
                    return
            except (requests.RequestException, KeyError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"smg not routing to {workers} workers of {model_id}: {self.log_text()}")

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()
