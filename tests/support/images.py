"""Small encoded images for the tests that send them (the bytes a client would upload)."""

import io

from PIL import Image


def png(width: int = 4, height: int = 3, color: tuple[int, int, int] = (200, 30, 60)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()
