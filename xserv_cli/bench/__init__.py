"""`xserv bench`: a load generator for any OpenAI-compatible endpoint (xserv, vLLM, SGLang, TGI,
transformers serve), in the manner of vLLM's benchmark_serving. A client only: no torch here.

Library use (benchmarks/compare.py does this):
    config = BenchConfig(base_url="http://127.0.0.1:8000/v1", model="m", concurrency=16)
    report = run_benchmark(config, random_prompts(64, input_len=128, seed=0))
    print(format_report(report))
"""

from xserv_cli.bench.config import BenchConfig
from xserv_cli.bench.prompts import file_prompts, random_prompts
from xserv_cli.bench.report import Report, format_report
from xserv_cli.bench.runner import run_benchmark

__all__ = ["BenchConfig", "Report", "file_prompts", "format_report", "random_prompts", "run_benchmark"]
