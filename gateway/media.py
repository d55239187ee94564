"""Images as clients send them: a chat message's image parts found and read into PIL images.

The APIs' image parts arrive here in one form, ``{"type": "image", "url": ...}`` (the chat
route's ``image_url``, Anthropic's ``image`` block, Responses' ``input_image``); ``take_images``
swaps each for the bare ``{"type": "image"}`` a chat template writes its placeholder for, and
``read_image`` reads the URL: a ``data:`` URL's bytes, a file under ``--allowed-local-media-path``,
or an http(s) URL fetched within ``--media-fetch-timeout``, ``--media-max-bytes`` and
``--media-max-redirects``, from a host in ``--allowed-media-domains`` when that is set. Every
failure is an InvalidRequestError (400) that names the part; nothing here reaches the engine.
"""

from __future__ import annotations

import base64
import hashlib
import io
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from mlxd.shared.serve_config import GatewayConfig
from mlxd.shared.errors import InvalidRequestError


@dataclass
class Image:
    """A decoded image (PIL, RGB) and the digest of its bytes (its identity in the prefix cache)."""

    pil: object
    digest: str


def anthropic_image_url(source, where: str) -> str:
    """The URL of an Anthropic ``image`` block's source: its own (``url``), or a data URL of its
    ``base64`` data."""
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    if (isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str)
            and isinstance(source.get("media_type"), str)):
        return f"data:{source['media_type']};base64,{source['data']}"
    raise InvalidRequestError("an image block's source must be {type: base64, media_type, data} or {type: url, url}",
                              param=f"{where}.source")


def take_images(messages: list[dict], limit: int) -> list[str]:
    """The URLs of ``messages``' image parts in order, each part replaced by ``{"type": "image"}``
    in place; more than ``limit`` (``--limit-mm-per-prompt``'s image count) is a 400."""
    urls = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image":
                urls.append(part["url"])
                content[j] = {"type": "image"}
    if len(urls) > limit:
        raise InvalidRequestError(f"this prompt has {len(urls)} images; at most {limit} are allowed "
                                  "(--limit-mm-per-prompt)", param="messages")
    return urls


def _decode(data: bytes, where: str, max_pixels: int) -> Image:
    from PIL import Image as PILImage

    try:
        with PILImage.open(io.BytesIO(data)) as im:
            if im.width * im.height > max_pixels:
                raise InvalidRequestError(f"{where}: the image has {im.width}x{im.height} pixels, more than "
                                          f"{max_pixels} (--media-max-pixels)", param="messages")
            im.load()  # truncated data fails here, not later in the processor
            pil = im.convert("RGB")
    except InvalidRequestError:
        raise
    except (OSError, ValueError, SyntaxError, PILImage.DecompressionBombError) as e:
        raise InvalidRequestError(f"{where}: the image cannot be decoded ({e})", param="messages") from None
    return Image(pil, hashlib.sha256(data).hexdigest())


def _data_url(url: str, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise InvalidRequestError(f"{where}: a data URL must be data:<type>;base64,<data>", param="messages")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:
        raise InvalidRequestError(f"{where}: the data URL is not valid base64", param="messages") from None


def _local(url: str, where: str, root: str | None) -> bytes:
    if root is None:
        raise InvalidRequestError(f"{where}: file URLs are not allowed (--allowed-local-media-path is not set)",
                                  param="messages")
    path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)).resolve()
    if not path.is_relative_to(Path(root).resolve()):
        raise InvalidRequestError(f"{where}: the file is not under --allowed-local-media-path", param="messages")
    try:
        return path.read_bytes()
    except OSError as e:
        raise InvalidRequestError(f"{where}: the file cannot be read ({e.strerror})", param="messages") from None


def _fetch(url: str, where: str, cfg: GatewayConfig) -> bytes:
    """GET ``url`` by hand, one hop at a time, so that each redirect's host is checked too."""
    import http.client

    for _ in range(cfg.media_max_redirects + 1):
        parts = urllib.parse.urlparse(url)
        host = (parts.hostname or "").lower()
        if cfg.allowed_media_domains and host not in cfg.allowed_media_domains:
            raise InvalidRequestError(f"{where}: the host {host!r} is not in --allowed-media-domains",
                                      param="messages")
        conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_class(host, parts.port, timeout=cfg.media_fetch_timeout)
        try:
            conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""))
            resp = conn.getresponse()
            if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                url = urllib.parse.urljoin(url, resp.getheader("Location"))
                continue
            if resp.status != 200:
                raise InvalidRequestError(f"{where}: fetching the image answered HTTP {resp.status}",
                                          param="messages")
            data = resp.read(cfg.media_max_bytes + 1)
            if len(data) > cfg.media_max_bytes:
                raise InvalidRequestError(f"{where}: the image is larger than {cfg.media_max_bytes} bytes "
                                          "(--media-max-bytes)", param="messages")
            return data
        except (OSError, http.client.HTTPException) as e:
            raise InvalidRequestError(f"{where}: the image could not be fetched ({type(e).__name__}: {e})",
                                      param="messages") from None
        finally:
            conn.close()
    raise InvalidRequestError(f"{where}: more than {cfg.media_max_redirects} redirects (--media-max-redirects)",
                              param="messages")


def read_image(url: str, index: int, cfg: GatewayConfig) -> Image:
    """Image ``index`` of the prompt, read from ``url``; blocking (run it in a worker thread)."""
    where = f"image {index}"
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{where}: no URL", param="messages")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        data = _data_url(url, where)
    elif scheme == "file":
        data = _local(url, where, cfg.allowed_local_media_path)
    elif scheme in ("http", "https"):
        data = _fetch(url, where, cfg)
    else:
        raise InvalidRequestError(f"{where}: a URL must be data:, http(s): or file: (got {scheme!r})",
                                  param="messages")
    return _decode(data, where, cfg.media_max_pixels)
