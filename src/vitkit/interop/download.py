"""Getting weights files: Hugging Face Hub files through ``huggingface_hub`` (its cache, ``HF_HOME``,
``HF_HUB_OFFLINE``, revisions, tokens), URLs into torch.hub's cache (``TORCH_HOME``) with a progress bar.

A URL download is written to ``NAME.part`` and renamed only once every byte the server announced has arrived and
the sha256 (where known) matches, so an interrupted transfer never leaves a file that looks whole: the next call
starts it again cleanly. (torch.hub's own downloader keeps whatever arrived when a connection closes early.)
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

CHUNK = 1 << 20
PROBE_S = 3.0  # how long the Hub's host may take to accept a connection before the network counts as absent


class DownloadError(OSError):
    """A file could not be fetched; the message says which and what to do."""


def url_cache_dir() -> Path:
    import torch.hub  # only for its cache location (TORCH_HOME)

    return Path(torch.hub.get_dir()) / "checkpoints"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def download_url(url: str, filename: str | None = None, sha256: str | None = None, cache_dir: Path | None = None,
                 progress: bool = True, timeout: float = 60.0) -> Path:
    """The cached copy of ``url`` (downloaded first if missing), checked against ``sha256`` when given."""
    d = Path(cache_dir) if cache_dir else url_cache_dir()
    dst = d / (filename or url.rstrip("/").rsplit("/", 1)[-1])
    if dst.is_file():
        if sha256 and (found := sha256_of(dst)) != sha256:
            raise DownloadError(f"{dst}: sha256 {found} but {url} should have {sha256}; delete the file to download "
                                "it again")
        return dst
    d.mkdir(parents=True, exist_ok=True)
    part = dst.with_name(dst.name + ".part")
    part.unlink(missing_ok=True)  # a transfer that was cut off earlier starts again from the beginning
    by_hand = f"download it on a machine with internet and place it at {dst}, or pass the local file instead"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "vitkit"}),
                                    timeout=timeout) as r:
            total = int(r.headers["Content-Length"]) if r.headers.get("Content-Length") else None
            h, got = hashlib.sha256(), 0
            from tqdm import tqdm  # the progress bar

            with open(part, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                             desc=dst.name, disable=not progress) as bar:
                while block := r.read(CHUNK):
                    f.write(block)
                    h.update(block)
                    got += len(block)
                    bar.update(len(block))
        if total is not None and got != total:
            raise DownloadError(f"{url}: the transfer stopped after {got} of {total} bytes; nothing was kept, run "
                                f"again to restart it (or {by_hand})")
        if sha256 and h.hexdigest() != sha256:
            raise DownloadError(f"{url}: downloaded sha256 {h.hexdigest()} differs from the expected {sha256}; "
                                "nothing was kept (a changed or corrupted file)")
        os.replace(part, dst)
        return dst
    except urllib.error.HTTPError as e:
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}: the server does not give this file; check the URL, "
                            f"or {by_hand}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        raise DownloadError(f"{url}: could not download ({reason}); no network here? {by_hand[0].upper()}"
                            f"{by_hand[1:]}") from None
    finally:
        part.unlink(missing_ok=True)


def hub_file(repo_id: str, filename: str, revision: str | None = None, token: str | bool | None = None) -> Path:
    """A file of a Hugging Face Hub repo, from ``huggingface_hub``'s cache or downloaded into it."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache  # an optional part of loading
    from huggingface_hub.errors import (  # likewise
        EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError)

    if not constants.HF_HUB_OFFLINE and not reachable(constants.ENDPOINT):
        # no network: the cached copy at once, or a clear error at once (hf_hub_download retries for ~30 s first)
        cached = try_to_load_from_cache(repo_id, filename, revision=revision)
        if isinstance(cached, str):
            return Path(cached)
        _not_cached(repo_id, filename, f"{constants.ENDPOINT} did not answer within {PROBE_S:g} s (no network?)")
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision, token=token))
    except (LocalEntryNotFoundError, OSError) as e:  # not cached, and offline or no network
        if isinstance(e, RepositoryNotFoundError):
            raise DownloadError(f"hf.co/{repo_id}: no such repository (or it is private: log in with "
                                "`hf auth login` or set HF_TOKEN)") from None
        if isinstance(e, EntryNotFoundError) and not isinstance(e, LocalEntryNotFoundError):
            raise DownloadError(f"hf.co/{repo_id} has no file {filename!r}") from None
        from huggingface_hub.constants import HF_HUB_OFFLINE  # read at the time of the error

        _not_cached(repo_id, filename, "HF_HUB_OFFLINE is set" if HF_HUB_OFFLINE else
                    f"no network? ({type(e).__name__})")


def _not_cached(repo_id: str, filename: str, why: str) -> None:
    from huggingface_hub.constants import HF_HUB_CACHE  # imported when the Hub is used (start-up time)

    raise DownloadError(f"could not get {filename} of hf.co/{repo_id}: it is not in the cache ({HF_HUB_CACHE}) "
                        f"and {why}. On a machine with internet run `hf download {repo_id} {filename}` "
                        "(huggingface_hub's command) and copy its cache to HF_HOME here; or, with the file itself, "
                        "`vitkit import FILE --preprocessing NAME.TAG --out DIR` keeps its publisher's "
                        "preprocessing, then use DIR") from None


def reachable(url: str, timeout: float = PROBE_S) -> bool:
    """Whether ``url``'s host accepts a TCP connection within ``timeout`` seconds. Behind a proxy: assumed (the
    proxy decides, and the download says what it said)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    u = urllib.parse.urlparse(url)
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout).close()
    except OSError:
        return False
    return True


def resolve(source: str, revision: str | None = None, progress: bool = True) -> tuple[Path, str | None]:
    """(local path, format or None to detect) for ``hf-hub:ORG/REPO``, ``ORG/REPO`` (a Hub id), a URL or a path."""
    if source.startswith(("http://", "https://")):
        return download_url(source, progress=progress), None
    local = Path(source).expanduser()
    if local.exists():
        return local, None
    repo = source.removeprefix("hf-hub:")
    if repo.count("/") == 1 and not source.startswith((".", "/", "~")):
        config = hub_file(repo, "config.json", revision)
        weights = hub_file(repo, "model.safetensors", revision)
        meta = json.loads(config.read_text())
        if meta.get("model_type") == "vit":
            return config.parent, "hf"  # transformers reads the snapshot folder: config.json beside the weights
        if meta.get("library") == "vitkit":  # `vitkit push`'s: vitkit's folder (its config.json is timm's too)
            return config.parent, "vitkit"
        return weights, "timm"
    raise FileNotFoundError(f"{source}: not a file or folder, a URL, a Hub id (ORG/REPO or hf-hub:ORG/REPO) or a "
                            "registered name (`vitkit models --pretrained`)")
