"""A Hugging Face Hub on loopback for the tests (no network): the endpoints huggingface_hub's ``create_repo``,
``create_branch``, ``upload_folder`` (preupload, the LFS batch API with "basic" transfers, the NDJSON commit) and
``hf_hub_download`` (HEAD + GET of ``/resolve/``) call, as their client code sends and reads them. Files the Hub
would keep in LFS (binary ones) go through the LFS batch and PUT, the others inline in the commit, as on the Hub.

Point a process at it with ``HF_ENDPOINT=hub.url`` (read when huggingface_hub is imported), ``HF_TOKEN=hub.token``
and ``HF_HUB_DISABLE_XET=1`` (the Hub's Xet storage needs its own CAS server)."""
from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml


class FakeHub:
    def __init__(self, token: str = "hf_test_token", user: str = "me") -> None:
        self.token, self.user = token, user
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "branches": {name: {path: bytes}}, ...}
        self.lfs: dict[str, bytes] = {}  # sha256 -> bytes uploaded through the LFS batch API
        self.requests: list[tuple[str, str]] = []  # (method, path) in order
        self.commits: list[dict] = []  # every commit's header and file paths
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _send(self, code: int, body: bytes | dict | None = None, headers: dict | None = None,
                      head: bool = False) -> None:
                data = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if isinstance(body, dict):
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def _authorised(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    self._send(401, {"error": "Invalid credentials in Authorization header"})
                    return False
                return True

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                path = unquote(urlsplit(self.path).path)
                hub.requests.append(("POST", path))
                body = self._body()
                if path == "/api/validate-yaml":
                    return self._validate_yaml(json.loads(body))
                if not self._authorised():
                    return None
                if path == "/api/repos/create":
                    return self._create(json.loads(body))
                if path.endswith(".git/info/lfs/objects/batch"):
                    return self._lfs_batch(json.loads(body))
                parts = path.split("/")  # /api/models/NS/NAME/<what>/<rev>
                if len(parts) >= 7 and parts[:3] == ["", "api", "models"]:
                    repo, what, rev = f"{parts[3]}/{parts[4]}", parts[5], "/".join(parts[6:])
                    if repo not in hub.repos:
                        return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    if what == "preupload":
                        return self._preupload(json.loads(body))
                    if what == "commit":
                        return self._commit(repo, rev, body)
                    if what == "branch":
                        branches = hub.repos[repo]["branches"]
                        if rev in branches:
                            return self._send(409, {"error": "Reference already exists"})
                        branches[rev] = dict(branches["main"])
                        hub.repos[repo]["sha"][rev] = hub.repos[repo]["sha"]["main"]
                        return self._send(200, {})
                return self._send(404, {"error": f"no route {path}"})

            def do_PUT(self) -> None:  # noqa: N802
                path = urlsplit(self.path).path
                hub.requests.append(("PUT", path))
                data = self._body()
                oid = path.rsplit("/", 1)[-1]
                if hashlib.sha256(data).hexdigest() != oid:
                    return self._send(400, {"error": "sha256 mismatch"})
                hub.lfs[oid] = data
                return self._send(200, {})

            def do_HEAD(self) -> None:  # noqa: N802
                self._resolve(head=True)

            def do_GET(self) -> None:  # noqa: N802
                self._resolve(head=False)

            def _resolve(self, head: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append(("HEAD" if head else "GET", path))
                parts = path.split("/")  # /NS/NAME/resolve/REV/FILE...
                if path.startswith("/api/models/"):  # repo info: /api/models/NS/NAME[/revision/REV]
                    repo = "/".join(parts[3:5])
                    rev = parts[6] if len(parts) > 6 else "main"
                    if repo not in hub.repos or rev not in hub.repos[repo]["branches"]:
                        return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    files = hub.repos[repo]["branches"][rev]
                    return self._send(200, {"id": repo, "sha": hub.repos[repo]["sha"][rev], "private":
                                            hub.repos[repo]["private"],
                                            "siblings": [{"rfilename": f} for f in sorted(files)]}, head=head)
                if len(parts) < 6 or parts[3] != "resolve":
                    return self._send(404, {"error": f"no route {path}"}, head=head)
                repo, rev, name = f"{parts[1]}/{parts[2]}", parts[4], "/".join(parts[5:])
                if repo not in hub.repos:
                    return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"},
                                      head=head)
                # a branch, or a commit's sha (clients ask by the sha once a first answer named it)
                snapshots = {**hub.repos[repo]["snapshots"], **hub.repos[repo]["branches"]}
                if rev not in snapshots:
                    return self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"},
                                      head=head)
                sha = hub.repos[repo]["sha"].get(rev, rev)
                if name not in snapshots[rev]:
                    return self._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound",
                                                                          "X-Repo-Commit": sha}, head=head)
                data = snapshots[rev][name]
                return self._send(200, data, {"X-Repo-Commit": sha,
                                              "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, head=head)

            def _validate_yaml(self, req: dict) -> None:
                text = req.get("content", "")
                if text.startswith("---"):
                    try:
                        meta = yaml.safe_load(text.split("---")[1])
                    except yaml.YAMLError as e:
                        return self._send(400, {"errors": [{"message": str(e)}]})
                    if not isinstance(meta, dict):
                        return self._send(400, {"errors": [{"message": "metadata is not a mapping"}]})
                return self._send(200, {"errors": [], "warnings": []})

            def _create(self, req: dict) -> None:
                repo = f"{req.get('organization') or hub.user}/{req['name']}"
                if repo in hub.repos:
                    return self._send(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo}"})
                hub.repos[repo] = {"private": req.get("visibility") == "private", "branches": {"main": {}},
                                   "sha": {"main": "0" * 40}, "snapshots": {"0" * 40: {}}}
                return self._send(200, {"url": f"{hub.url}/{repo}", "name": repo})

            def _preupload(self, req: dict) -> None:
                files = []
                for f in req["files"]:
                    sample = base64.b64decode(f["sample"])
                    lfs = b"\0" in sample or f["size"] > 10 * 2 ** 20  # the Hub keeps binary and big files in LFS
                    files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False})
                return self._send(200, {"files": files})

            def _lfs_batch(self, req: dict) -> None:
                objects = [{"oid": o["oid"], "size": o["size"],
                            "actions": {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}}
                           for o in req["objects"]]
                return self._send(200, {"transfer": "basic", "objects": objects})

            def _commit(self, repo: str, rev: str, body: bytes) -> None:
                branches = hub.repos[repo]["branches"]
                if rev not in branches:
                    return self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                files = dict(branches[rev])
                header, paths = {}, []
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    v = item["value"]
                    if item["key"] == "header":
                        header = v
                    elif item["key"] == "file":
                        files[v["path"]] = base64.b64decode(v["content"])
                        paths.append(v["path"])
                    elif item["key"] == "lfsFile":
                        if v["oid"] not in hub.lfs:
                            return self._send(400, {"error": f"LFS object {v['oid']} was never uploaded"})
                        files[v["path"]] = hub.lfs[v["oid"]]
                        paths.append(v["path"])
                    else:
                        return self._send(400, {"error": f"unsupported commit item {item['key']}"})
                sha = hashlib.sha1(body).hexdigest()
                branches[rev] = files
                hub.repos[repo]["sha"][rev] = sha
                hub.repos[repo]["snapshots"][sha] = files
                hub.commits.append({"repo": repo, "revision": rev, "header": header, "paths": paths})
                return self._send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha,
                                        "pullRequestUrl": None})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def env(self, home: str) -> dict[str, str]:
        """What a process needs to talk to this Hub, its cache in ``home``."""
        return {"HF_ENDPOINT": self.url, "HF_TOKEN": self.token, "HF_HUB_DISABLE_XET": "1", "HF_HOME": home,
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "10",
                "HF_HUB_DOWNLOAD_TIMEOUT": "10"}
