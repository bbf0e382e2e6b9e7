"""The browser demo: FastAPI serving one self-contained page (no CDN, works offline) and a JSON API.

Why FastAPI over Gradio: the page must work with no internet (Gradio pulls fonts and assets from CDNs), the
dependency is a fraction of the size, and upload limits sit in our code where they can be tested.
"""
from __future__ import annotations

import asyncio
import io
import signal
import socket
import threading
from email.parser import BytesParser
from email.policy import HTTP
from importlib import resources
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.requests import ClientDisconnect
from PIL import Image

from .batcher import Batcher, Busy
from .predictor import Limits, Predictor, UploadError, available_methods


def create_app(predictor: Predictor, examples: list[tuple[str, Image.Image]] | None = None) -> FastAPI:
    app = FastAPI(title="vitkit demo", docs_url=None, redoc_url=None)
    pngs: list[tuple[str, bytes]] = []
    for label, im in examples or []:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        pngs.append((label, buf.getvalue()))
    page = (resources.files("vitkit.serving") / "page.html").read_text()

    def error(message: str, status: int) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return page

    @app.get("/api/info")
    def info() -> dict[str, Any]:
        c = predictor.model.config
        return {"classes": predictor.names, "img_size": c.to_dict()["img_size"], "in_chans": c.in_chans,
                "max_bytes": predictor.limits.max_bytes, "max_pixels": predictor.limits.max_pixels,
                "methods": available_methods(),
                "examples": [{"label": label, "url": f"/api/examples/{i}.png"} for i, (label, _) in enumerate(pngs)]}

    @app.get("/api/examples/{i}.png")
    def example(i: int) -> Response:
        if not 0 <= i < len(pngs):
            return error(f"no example {i}", 404)
        return Response(pngs[i][1], media_type="image/png")

    limits = predictor.limits
    batcher = Batcher(predictor.predict_batch, predictor.workers, limits.max_batch, limits.max_queue)
    uploading = [0]  # uploads being received or predicted now

    def busy() -> JSONResponse:
        return JSONResponse({"error": "the server is busy; retrying in a moment", "busy": True}, status_code=503,
                            headers={"Retry-After": "1"})

    @app.post("/api/predict")
    async def predict(request: Request) -> Response:
        if uploading[0] >= limits.max_connections:  # said at once, in JSON the page understands
            return busy()
        uploading[0] += 1
        try:
            return await _predict(request)
        finally:
            uploading[0] -= 1

    async def _predict(request: Request) -> Response:
        try:  # ?method=grad-rollout&target=3 (a class index or name): what the overlay explains
            ask = predictor.ask(request.query_params.get("method"), request.query_params.get("target"))
        except UploadError as e:
            return error(str(e), e.status)
        # read the body ourselves, stopping at the limit: the client's filename is never looked at
        length = int(request.headers.get("content-length") or 0)
        limit = limits.max_bytes
        if length > limit + 64 * 1024:
            return error(f"upload is {length / 1e6:.1f} MB; the limit is {limit / 1e6:.0f} MB", 413)
        body = bytearray()
        stream = request.stream().__aiter__()
        try:
            async with asyncio.timeout(limits.body_timeout_s):  # a slow or stalled upload does not hold a slot
                async with asyncio.timeout(limits.first_byte_timeout_s):  # nor do headers with no body after them
                    chunk = await anext(stream, b"")
                while chunk:
                    body += chunk
                    if len(body) > limit + 64 * 1024:
                        return error(f"upload is larger than the limit of {limit / 1e6:.0f} MB", 413)
                    chunk = await anext(stream, b"")
        except TimeoutError:
            return error(f"the upload did not arrive in time ({limits.first_byte_timeout_s:g} s to start, "
                         f"{limits.body_timeout_s:g} s in all); try again or a smaller file", 408)
        except ClientDisconnect:  # the client left: nobody to answer, nothing to log
            return Response(status_code=400)
        try:
            data = _file_part(bytes(body), request.headers.get("content-type", ""))
            return JSONResponse(await batcher.submit((data, ask)))
        except Busy:
            return busy()
        except UploadError as e:
            return error(str(e), e.status)

    return app


def _file_part(body: bytes, content_type: str) -> bytes:
    """The bytes of the first file field of a multipart body (or the raw body for other content types)."""
    if not content_type.startswith("multipart/form-data"):
        return body
    msg = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    if msg.defects or not msg.is_multipart():
        raise UploadError("malformed upload: expected a multipart form with the image in a field named 'file'")
    for part in msg.iter_parts():
        if part.get_param("name", header="content-disposition") == "file":
            return part.get_payload(decode=True) or b""
    raise UploadError("malformed upload: the form has no field named 'file'")


def serve(predictor: Predictor, host: str, port: int, examples=None,  # type: ignore[no-untyped-def]
          on_ready: Callable[[str], None] = print) -> str | None:
    """Serve until interrupted; returns "SIGTERM" where that ended it. The socket is bound first, so ``on_ready``
    is told the real address (``port`` 0 picks a free one). Uploads past ``limits.max_connections`` are answered by
    the app (JSON 503 with Retry-After); uvicorn's own limit, which answers in plain text, is set far above it to
    bound memory only."""
    import uvicorn  # optional: the serve extra

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    real_port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(predictor, examples), log_level="warning", timeout_keep_alive=5,
                            limit_concurrency=4 * predictor.limits.max_connections + 64,
                            http=header_timeout_protocol(predictor.limits.header_timeout_s))
    on_ready(f"http://{f'[{host}]' if family == socket.AF_INET6 else host}:{real_port}")
    # SIGTERM (a service manager's stop, `kill`) is how a server is meant to end: uvicorn shuts down gracefully, then
    # raises the signal again under the handler it found, which by default killed the process with 143. Noted
    # here instead, so that it ends as a finished command does.
    stopped: list[str] = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.append("SIGTERM")) if main else None
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return stopped[0] if stopped else None


def header_timeout_protocol(seconds: float):  # type: ignore[no-untyped-def]
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request headers are not complete within ``seconds``
    of its opening or of its previous response. uvicorn times idle keep-alive connections only, so a client that
    sends half a request line and stalls held its connection for ever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol  # optional: the serve extra

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport):  # type: ignore[no-untyped-def,override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request's headers are in: the app's own timeouts take over
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._headers_overdue)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_overdue(self) -> None:
            self._header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


__all__ = ["create_app", "serve", "Limits", "Predictor"]
