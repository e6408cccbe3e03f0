"""GetTokenizer's payload: the model directory's tokenizer files as one zip, in 64 KiB chunks,
the last one carrying the zip's SHA-256 (what SMG checks before it unpacks)."""

import hashlib
import io
import zipfile
from pathlib import Path

CHUNK_SIZE = 64 * 1024
FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.json")
PATTERNS = ("*.jinja",)


def tokenizer_zip(model_dir: Path) -> tuple[bytes, str]:
    """(zip bytes, hex SHA-256). Files are added in a fixed order with fixed timestamps, so the
    same directory always gives the same bytes and digest."""
    names = [name for name in FILES if (model_dir / name).is_file()]
    names += sorted({p.name for pattern in PATTERNS for p in model_dir.glob(pattern) if p.is_file()} - set(names))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), (model_dir / name).read_bytes(),
                             compress_type=zipfile.ZIP_DEFLATED)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes) -> list[bytes]:
    return [data[i:i + CHUNK_SIZE] for i in range(0, len(data), CHUNK_SIZE)] or [b""]
