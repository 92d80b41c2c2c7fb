"""A stand-in for the Hugging Face Hub on 127.0.0.1, for the real `huggingface_hub` client (point HF_ENDPOINT
at `LocalHub.url`). It answers the calls `snapshot_download` makes, the way the Hub answers them:

    GET  /api/models/<org>/<name>[/revision/<rev>]   model info: commit sha, file list, gated flag
    GET  /api/models/<org>/<name>/tree/<sha>         recursive file listing
    HEAD /<org>/<name>/resolve/<rev>/<file>          X-Repo-Commit, ETag, Content-Length
    GET  /<org>/<name>/resolve/<rev>/<file>          the bytes; `Range: bytes=N-` answers 206 from offset N

and, for dataset repos (`add_dataset`), the calls `datasets.load_dataset` makes through huggingface_hub:

    GET  /api/datasets/<org>/<name>[/revision/<rev>]             dataset info: sha, siblings, gated flag
    GET  /api/datasets/<org>/<name>/tree/<rev>[/<folder>]        a folder's listing (`?recursive=true`: all below)
    POST /api/datasets/<org>/<name>/paths-info/<rev>             the entries of the paths named in the form
    HEAD/GET /datasets/<org>/<name>/resolve/<rev>/<path>         a file's bytes, as for models

Errors carry the Hub's X-Error-Code header, which huggingface_hub turns into its typed errors (RepoNotFound,
RevisionNotFound, EntryNotFound, GatedRepo). Failures are injectable: `drop_once[file] = n` closes the
connection after n bytes of that file's first GET; `stall[file] = n` sends n bytes and then hangs (until the
server stops), so a test can kill the downloading process half way.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class Revision:
    sha: str
    files: dict[str, bytes]


@dataclass
class Repo:
    revisions: dict[str, Revision] = field(default_factory=dict)
    """Branch or tag name -> revision; the sha of each revision answers too."""
    token: str | None = None
    """Gated: file downloads need `Authorization: Bearer <token>`."""

    def find(self, revision: str) -> Revision | None:
        if revision in self.revisions:
            return self.revisions[revision]
        return next((r for r in self.revisions.values() if r.sha == revision), None)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


class LocalHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.datasets: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.drop_once: dict[str, int] = {}
        self.stall: dict[str, int] = {}
        self.completed: list[str] = []
        """Files whose GET response was sent in full, in order."""
        self._stop = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add_repo(
        self, repo_id: str, directory: Path, revision: str = "main", token: str | None = None
    ) -> Revision:
        """Serve the files of `directory` (top level) as model `repo_id` at `revision`."""
        files = {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}
        return _add_revision(self.repos, repo_id, files, revision, token)

    def add_dataset(
        self, repo_id: str, directory: Path, revision: str = "main", token: str | None = None
    ) -> Revision:
        """Serve the files of `directory` and its subfolders as dataset `repo_id` at `revision`."""
        directory = Path(directory)
        files = {
            p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*"))
            if p.is_file()
        }
        return _add_revision(self.datasets, repo_id, files, revision, token)

    def gets(self, file_name: str) -> list[Request]:
        """The GET requests for one file, in order."""
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + file_name)]

    def __enter__(self) -> LocalHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()


def _add_revision(
    repos: dict[str, Repo], repo_id: str, files: dict[str, bytes], revision: str, token: str | None
) -> Revision:
    digest = hashlib.sha1(repo_id.encode() + revision.encode())
    for name, data in files.items():
        digest.update(name.encode() + hashlib.sha256(data).digest())
    repo = repos.setdefault(repo_id, Repo())
    repo.token = token if token is not None else repo.token
    repo.revisions[revision] = Revision(sha=digest.hexdigest(), files=files)
    return repo.revisions[revision]


def _handler_for(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet test output
            pass

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def do_GET(self) -> None:
            self._answer(send_body=True)

        def do_POST(self) -> None:
            self._answer(send_body=True)

        def _answer(self, send_body: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            hub.requests.append(
                Request(self.command, path, self.headers.get("Range"), self.headers.get("Authorization"))
            )
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "datasets"] and len(parts) >= 4:
                self._dataset_api(f"{parts[2]}/{parts[3]}", parts[4:], parse_qs(url.query))
            elif parts[:2] == ["api", "models"] and len(parts) in (4, 6):
                kind, revision = parts[4:6] if len(parts) == 6 else ("revision", "main")
                self._api(f"{parts[2]}/{parts[3]}", kind, revision)
            elif parts[0] == "datasets" and len(parts) >= 6 and parts[3] == "resolve":
                self._resolve(
                    f"{parts[1]}/{parts[2]}",
                    parts[4],
                    "/".join(parts[5:]),
                    send_body,
                    hub.datasets,
                    "dataset",
                )
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), send_body)
            else:
                self._error(404, "RepoNotFound", "Repository not found")

        def _dataset_api(self, repo_id: str, rest: list[str], query: dict[str, list[str]]) -> None:
            repo = hub.datasets.get(repo_id)
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found")
            kind, revision_name = (rest[0], unquote(rest[1])) if len(rest) >= 2 else ("revision", "main")
            revision = repo.find(revision_name)
            if revision is None:
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            if (
                repo.token
                and self.headers.get("Authorization") != f"Bearer {repo.token}"
                and kind != "revision"
            ):
                return self._error(
                    401,
                    "GatedRepo",
                    f"Access to dataset {repo_id} is restricted. You must have access to it.",
                )
            if kind == "revision":
                return self._json(
                    {
                        "id": repo_id,
                        "sha": revision.sha,
                        "private": False,
                        "gated": "manual" if repo.token else False,
                        "siblings": [{"rfilename": name} for name in revision.files],
                    }
                )
            if kind == "tree":
                folder = "/".join(rest[2:])
                recursive = query.get("recursive", ["false"])[0].lower() == "true"
                return self._json(_listing(revision.files, folder, recursive))
            if kind == "paths-info":
                length = int(self.headers.get("Content-Length") or 0)
                form = parse_qs(self.rfile.read(length).decode())
                wanted = form.get("paths", [])
                entries = [e for e in _listing(revision.files, "", True) if e["path"] in wanted]
                return self._json(entries)
            self._error(404, "RepoNotFound", "Repository not found")

        def _api(self, repo_id: str, kind: str, revision_name: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:  # the Hub answers 401 to anonymous requests for repos it does not show
                return self._error(401, "RepoNotFound", "Repository not found")
            revision = repo.find(revision_name)
            if revision is None:
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            if kind == "revision":
                info = {
                    "id": repo_id,
                    "sha": revision.sha,
                    "private": False,
                    "gated": "manual" if repo.token else False,
                    "siblings": [{"rfilename": name} for name in revision.files],
                }
                return self._json(info)
            if kind == "tree":
                listing = [
                    {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in revision.files.items()
                ]
                return self._json(listing)
            self._error(404, "RepoNotFound", "Repository not found")

        def _resolve(
            self,
            repo_id: str,
            revision_name: str,
            file_name: str,
            send_body: bool,
            repos: dict[str, Repo] | None = None,
            kind: str = "model",
        ) -> None:
            repo = (hub.repos if repos is None else repos).get(repo_id)
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found")
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                return self._error(
                    401, "GatedRepo", f"Access to {kind} {repo_id} is restricted. You must have access to it."
                )
            revision = repo.find(unquote(revision_name))
            if revision is None:
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            data = revision.files.get(file_name)
            if data is None:
                return self._error(404, "EntryNotFound", "Entry not found", commit=revision.sha)
            start = _range_start(self.headers.get("Range"))
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", revision.sha)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not send_body:
                return
            body = data[start:]
            if file_name in hub.drop_once:
                cut = hub.drop_once.pop(file_name)
                self._send_part_and_close(body[:cut])
                return
            if file_name in hub.stall:
                self.wfile.write(body[: hub.stall[file_name]])
                self.wfile.flush()
                while not hub._stop.wait(0.1):
                    pass
                self.close_connection = True
                return
            self.wfile.write(body)
            hub.completed.append(file_name)

        def _send_part_and_close(self, part: bytes) -> None:
            self.wfile.write(part)
            self.wfile.flush()
            time.sleep(0.05)
            self.close_connection = True
            self.connection.shutdown(2)

        def _json(self, value: object) -> None:
            body = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

    return Handler


def _listing(files: dict[str, bytes], folder: str, recursive: bool) -> list[dict]:
    """Tree entries under `folder` the way the Hub lists them: files with size and oid, and folders."""
    prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
    entries: dict[str, dict] = {}
    for name, data in files.items():
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix) :].split("/")
        for depth in range(1, len(parts)):
            directory = prefix + "/".join(parts[:depth])
            if recursive or depth == 1:
                entries.setdefault(directory, {"type": "directory", "path": directory, "oid": "0" * 40})
            if not recursive:
                break
        if recursive or len(parts) == 1:
            entries[name] = {
                "type": "file",
                "path": name,
                "size": len(data),
                "oid": hashlib.sha1(data).hexdigest(),
            }
    return sorted(entries.values(), key=lambda entry: entry["path"])


def _range_start(header: str | None) -> int:
    """The offset of a `bytes=N-` range (the only form huggingface_hub sends when it resumes)."""
    if not header or not header.startswith("bytes="):
        return 0
    return int(header.removeprefix("bytes=").split("-")[0] or 0)
