"""A local stand-in for the Hugging Face hub that serves model folders over HTTP the way the hub
does (resolve/ HEAD and GET with ETag, X-Repo-Commit and Content-Length, the model-info API with
file sizes), so that huggingface_hub and transformers download from it for real."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "1" * 40


class FileHub(http.server.BaseHTTPRequestHandler):
    repos: dict = {}
    """repo id -> the folder whose files it serves."""
    requests: list = []

    def _file(self) -> tuple[str, Path | None]:
        path = unquote(urlparse(self.path).path).lstrip("/")
        for repo, folder in self.repos.items():
            prefix = f"{repo}/resolve/"
            if path.startswith(prefix):
                name = path[len(prefix) :].split("/", 1)[1]
                file = folder / name
                return "file", file if file.is_file() else None
        return "other", None

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _serve(self, head: bool) -> None:
        self.requests.append((self.command, self.path))
        kind, file = self._file()
        if kind == "file" and file is not None:
            body = file.read_bytes()
            etag = hashlib.sha256(body).hexdigest()
            self._send(200, body, {"ETag": f'"{etag}"', "X-Repo-Commit": COMMIT}, head)
            return
        if kind == "file":
            self._send(404, headers={"X-Error-Code": "EntryNotFound"}, head=head)
            return
        info = self._model_info()
        if info is None:
            self._send(404, headers={"X-Error-Code": "EntryNotFound"}, head=head)
            return
        self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)

    def _model_info(self) -> dict | None:
        path = unquote(urlparse(self.path).path)
        for repo, folder in self.repos.items():
            if path in (f"/api/models/{repo}", f"/api/models/{repo}/revision/main"):
                siblings = [
                    {"rfilename": p.name, "size": p.stat().st_size} for p in sorted(folder.iterdir()) if p.is_file()
                ]
                return {"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings}
        return None

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    def log_message(self, *args):
        pass


def serve_repos(repos: dict) -> tuple[str, http.server.ThreadingHTTPServer]:
    """Start a hub serving {repo id: folder}; returns (its endpoint, the server to shut down)."""
    handler = type("Handler", (FileHub,), {"repos": {k: Path(v) for k, v in repos.items()}, "requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}", server
