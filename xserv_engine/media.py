"""The bytes of an image a request names by URL, under this server's rules (vLLM's flags):
`data:` URLs (base64) always; http(s) only from the hosts of --allowed-media-domains, within
--media-fetch-timeout and --max-image-bytes; `file:` only under --allowed-local-media-path.

Torch-free: the REST front loads the URLs of image_url / input_image parts with it, the engine
the URLs SMG forwards in media_refs; the engine decodes the bytes either way. A fetch runs
on a thread of its own, so the request's thread waits at most the timeout whatever the remote
end does (DNS included); the fetch thread gives up by itself soon after.
"""

import argparse
import base64
import binascii
import http.client
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024
_CHUNK = 64 * 1024
# some image hosts (Wikimedia's among them) refuse urllib's default User-Agent
_HEADERS = {"Accept": "image/*", "User-Agent": "xserv (image fetch)"}


class MediaError(ValueError):
    """An image URL this server will not or cannot load; the message says why."""


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] = ()  # hosts http(s) images may come from; none: no fetching
    allowed_local_path: str | None = None  # a directory file: URLs may name files under; None: no files
    fetch_timeout_s: float = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
    max_bytes: int = 20 * MIB  # the largest image file, however it arrives

    def load(self, url: str) -> bytes:
        try:
            scheme = urllib.parse.urlsplit(url).scheme.lower()
            if scheme == "data":
                return self._data(url)
            if scheme in ("http", "https"):
                return self._fetch(url)
            if scheme == "file":
                return self._file(url)
        except MediaError:
            raise
        except ValueError as exc:  # urllib's and pathlib's word for a malformed URL or path
            raise MediaError(f"the URL is malformed ({exc})") from None
        raise MediaError("must be a data: URL (base64), an http(s) URL or a file: URL")

    def _data(self, url: str) -> bytes:
        head, comma, payload = url.partition(",")
        media_type, *params = head[len("data:"):].split(";")
        if not comma or "base64" not in params:
            raise MediaError("a data: URL must be base64-encoded (data:image/png;base64,...)")
        if media_type and not media_type.lower().startswith("image/"):
            raise MediaError(f"a data: URL here must hold an image, not {media_type}")
        if len(payload) * 3 // 4 > self.max_bytes:
            raise MediaError(f"the image is larger than this server's limit of {self.max_bytes} bytes")
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data: URL's base64 is invalid") from None
        if not data:
            raise MediaError("the data: URL holds no data")
        return data

    def _file(self, url: str) -> bytes:
        if self.allowed_local_path is None:
            raise MediaError("file: URLs are refused: this server was started without --allowed-local-media-path")
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError("a file: URL must name a local file (file:///path)")
        root = Path(self.allowed_local_path).resolve()
        path = Path(urllib.request.url2pathname(parts.path)).resolve()  # symbolic links and .. followed
        if not path.is_relative_to(root):
            raise MediaError(f"the file is not under --allowed-local-media-path ({root})")
        try:
            with path.open("rb") as file:
                data = file.read(self.max_bytes + 1)
        except OSError as exc:
            raise MediaError(f"cannot read the file: {exc.strerror}") from None
        return self._capped(data)

    def _fetch(self, url: str) -> bytes:
        self.check_host(url)
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(self._download(url)), name="image-fetch", daemon=True)
        thread.start()
        thread.join(self.fetch_timeout_s)
        if not outcome:
            raise self._timed_out()
        result = outcome[0]
        if isinstance(result, MediaError):
            raise result
        return result

    def _download(self, url: str) -> bytes | MediaError:
        """The body, or the error to report; never raises (it runs on its own thread)."""
        deadline = time.monotonic() + self.fetch_timeout_s
        opener = urllib.request.build_opener(_AllowedRedirects(self))
        try:
            with opener.open(urllib.request.Request(url, headers=_HEADERS),
                             timeout=self.fetch_timeout_s) as response:
                chunks, size = [], 0
                while size <= self.max_bytes and time.monotonic() < deadline:
                    chunk = response.read(_CHUNK)
                    if not chunk:
                        return self._capped(b"".join(chunks))
                    chunks.append(chunk)
                    size += len(chunk)
                return self._capped(b"".join(chunks)) if size > self.max_bytes else self._timed_out()
        except MediaError as exc:
            return exc
        except urllib.error.HTTPError as exc:
            return MediaError(f"fetching the image failed: HTTP {exc.code}")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc  # urllib's URLError wraps the socket's error
            return self._timed_out() if isinstance(reason, TimeoutError) else MediaError(
                f"fetching the image failed: {reason}")

    def _timed_out(self) -> MediaError:
        return MediaError(f"fetching the image took longer than {self.fetch_timeout_s:g} s")

    def check_host(self, url: str) -> None:
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if host not in {domain.lower() for domain in self.allowed_domains}:
            if not self.allowed_domains:
                raise MediaError("http(s) image URLs are refused: this server was started without "
                                 "--allowed-media-domains; send the image as a data: URL")
            raise MediaError(f"the host {host!r} is not in --allowed-media-domains")

    def _capped(self, data: bytes) -> bytes:
        if len(data) > self.max_bytes:
            raise MediaError(f"the image is larger than this server's limit of {self.max_bytes} bytes")
        if not data:
            raise MediaError("the image is empty")
        return data


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    media = parser.add_argument_group("images in requests (data: URLs are always accepted)")
    media.add_argument("--allowed-media-domains", nargs="+", action="extend", default=None, metavar="HOST",
                       help="hosts image URLs may be fetched from over http(s) (vLLM's flag); without it no "
                            "image URL is fetched")
    media.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="file: image URLs may name files under DIR (vLLM's flag; anyone who can send a "
                            "request can read them); without it file: URLs are refused")
    media.add_argument("--media-fetch-timeout", type=float, default=MediaPolicy.fetch_timeout_s, metavar="S",
                       help="seconds an image fetch may take, past which the request is refused (default %(default)g)")
    media.add_argument("--max-image-bytes", type=int, default=MediaPolicy.max_bytes, metavar="N",
                       help="largest image file accepted, however it arrives (default %(default)s)")


def media_policy_from_args(args: argparse.Namespace) -> MediaPolicy:
    """ValueError for a flag out of range."""
    if args.allowed_local_media_path is not None and not os.path.isdir(args.allowed_local_media_path):
        raise ValueError(f"--allowed-local-media-path {args.allowed_local_media_path}: no such directory")
    if args.media_fetch_timeout <= 0 or args.max_image_bytes < 1:
        raise ValueError("--media-fetch-timeout and --max-image-bytes must be positive")
    return MediaPolicy(tuple(args.allowed_media_domains or ()), args.allowed_local_media_path,
                       args.media_fetch_timeout, args.max_image_bytes)


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an http(s) URL on an allowed host."""

    def __init__(self, policy: MediaPolicy):
        self.policy = policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise MediaError("the image URL redirects to a URL that is not http(s)")
        self.policy.check_host(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)
