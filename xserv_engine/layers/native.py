"""Native CPU code, compiled once per machine with the system's C++ compiler and cached.

cpu_ops.cpp holds torch operators registered with TORCH_LIBRARY (torch.ops.xserv_cpu), built
against the installed torch's headers and libraries and loaded with torch.ops.load_library. It is
compiled with -march=native to ~/.cache/xserv/kernels, keyed by the source, the compiler, the
flags, torch's version and the CPU's flags: code built for one CPU model never runs on another.
Built beside its final name and renamed, so engines starting together never load half a file.
Without a compiler, or when the build fails, the engine takes the cpu-torch route (logged, with
the compiler's message). The one-time build and its absence are said at the default log level
(logger xserv.engine.startup): a first start spends a minute here, and a newcomer should know why."""

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from xserv_engine.user_cache import user_cache_dir

log = logging.getLogger(__name__)
startup = logging.getLogger("xserv.engine.startup")  # shown at the default level (server.cli.configure_logging)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC", "-std=c++17"]


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(source: Path, flags: list[str], what: str) -> Path | None:
    """The shared library of `source` (compiled now, or earlier and cached), or None, logged."""
    cxx = compiler()
    if cxx is None:
        startup.warning("no C++ compiler (g++ or $CXX): %s cannot be built; the engine runs plain torch ops "
                        "instead (route cpu-torch, slower; install g++ and restart to build them once)", what)
        return None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
        path = user_cache_dir() / "kernels" / f"{source.stem}-{_key(source, cxx, version, flags)}.so"
        if path.exists():
            log.info("%s: %s (compiled earlier)", what, path)
        else:
            startup.info("compiling %s (once per machine and torch version, cached in %s)", what, path.parent)
            start = time.perf_counter()
            _compile(cxx, source, flags, path)
            startup.info("compiled %s in %.1f s", what, time.perf_counter() - start)
        return path
    except (OSError, subprocess.SubprocessError) as exc:
        startup.warning("%s did not build (%s): the engine runs plain torch ops instead (route cpu-torch)", what,
                        getattr(exc, "stderr", None) or exc)
        return None


_torch_ops: bool | None = None


def load_torch_ops() -> bool:
    """cpu_ops.cpp's torch operators (torch.ops.xserv_cpu), built once per machine and loaded once
    per process; False, logged, where they cannot be."""
    global _torch_ops
    if _torch_ops is None:
        path = build(Path(__file__).with_name("cpu_ops.cpp"), FLAGS + torch_flags(), "the native CPU ops")
        _torch_ops = False
        if path is not None:
            try:
                torch.ops.load_library(str(path))
                _torch_ops = True
            except (OSError, RuntimeError) as exc:
                startup.warning("the native CPU ops did not load (%s): the engine runs plain torch ops instead "
                                "(route cpu-torch)", exc)
    return _torch_ops


def torch_flags() -> list[str]:
    """What a source that includes torch's headers and calls into libtorch compiles with."""
    from torch.utils import cpp_extension

    lib = Path(torch.__file__).parent / "lib"
    return ([f"-I{p}" for p in cpp_extension.include_paths()]
            + [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"])


def _key(source: Path, cxx: str, version: str, flags: list[str]) -> str:
    digest = hashlib.sha256(source.read_bytes())
    for part in (cxx, version, " ".join(flags), platform.machine(), _cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _compile(cxx: str, source: Path, flags: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        # flags after the source: the linker reads libraries after the objects that need them
        subprocess.run([cxx, str(source), *flags, "-o", tmp], capture_output=True, text=True, timeout=600,
                       check=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
