"""The web server of ``checkpoint-store ui``: a Flask app over a :class:`StoreView`.

One static page (``static/index.html`` with ``app.js``, ``style.css`` and
Chart.js, all shipped in the package: the page works without internet) and a
small JSON API it polls:

- ``GET /api/overview``: every experiment and trial under LOCATION.
- ``GET /api/trial?experiment=E&trial=T[&since=N]``: the trial's summary and
  checkpoints; with ``since``, its ``result.json`` rows from row N on.
- ``GET /api/series?experiment=E&trial=T&metric=M[&x=X&points=N&x_min=A&x_max=B]``:
  one metric as a chart line, decimated on the server (every checkpoint marker exact).
- ``GET /api/csv?experiment=E&trial=T``: the trial's rows as CSV;
  ``GET /api/csv?experiment=E``: the best row of each trial of the experiment.

The trial, series and overview answers carry an ``ETag``: a poll that sends it
back in ``If-None-Match`` gets ``304 Not Modified`` with no body while nothing
changed (the version is computed from what was read, before any answer is built).
- ``GET /api/checkpoint?experiment=E&trial=T&checkpoint=C``: one checkpoint.
- ``POST /api/verify`` (JSON ``{experiment, trial, checkpoint}``): the one
  action that is not a plain read; it still writes nothing.

Safety: names are checked by the view (one path component, listed under
LOCATION); the page builds every element from text, never from HTML strings,
and the Content-Security-Policy allows scripts from this server only; a
request whose ``Host`` is not the address served is refused (a DNS-rebinding
page cannot read the API); ``/api/verify`` needs a header a cross-site form
cannot send. Storage options (credentials) never reach a response or a log
line: responses carry URIs, names, metadata and library messages only.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from flask import Flask, Response, request, send_from_directory

from checkpoint_store._browse.output import json_safe
from checkpoint_store.errors import (
    CheckpointNotFoundError,
    CheckpointStoreError,
    InvalidConfigError,
)
from checkpoint_store.ui._model import SERIES_POINTS, StoreView

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
VERIFY_HEADER = "X-Checkpoint-Store"
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
        "form-action 'none'")

logger = logging.getLogger(__name__)


def _reply(obj: Any, status: int = 200) -> Response:
    # Strict JSON: a NaN metric becomes null (the browser's JSON.parse rejects NaN).
    body = json.dumps(json_safe(obj), allow_nan=False)
    return Response(body, status=status, mimetype="application/json")


def _conditional(version: str, build: Callable[[], Any]) -> Response:
    """``304`` when the client holds ``version`` already, else ``build()`` as JSON,
    tagged with it."""
    etag = f'"{version}"'
    if request.headers.get("If-None-Match") == etag:
        resp = Response(status=304)
    else:
        resp = _reply(build())
    resp.headers["ETag"] = etag
    return resp


def _number_arg(name: str, kind: Callable[[str], Any], default: Any = None) -> Any:
    value = request.args.get(name)
    if value is None or value == "":
        return default
    try:
        return kind(value)
    except ValueError:
        raise InvalidConfigError(f"{name} must be a number, got {value!r}") from None


#: What a spreadsheet reads as the start of a formula in a cell of text.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: Any) -> Any:
    """A CSV cell: text a spreadsheet would run as a formula (a trial, parameter
    or metric value "=HYPERLINK(...)" anyone writing to the store can choose)
    is prefixed with ``'``, which shows it as text (OWASP's CSV injection
    advice). Numbers, negative ones included, are written as they are."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def _csv(rows: list[dict[str, Any]], filename: str) -> Response:
    """``rows`` (flat dicts) as a CSV download; columns in first-seen order."""
    import csv
    import io

    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[_cell(c) for c in columns],
                            extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows({_cell(k): _cell(v) for k, v in row.items()} for row in rows)
    from urllib.parse import quote

    # Header values are Latin-1: an ASCII fallback name, and the real one in
    # RFC 5987's filename* (a trial named in any script downloads under its name).
    ascii_name = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_"
                         for c in filename)[:120]
    disposition = (f'attachment; filename="{ascii_name}.csv"; '
                   f"filename*=UTF-8''{quote(filename[:120] + '.csv', safe='')}")
    return Response(buf.getvalue(), mimetype="text/csv",
                    headers={"Content-Disposition": disposition})


def _error(exc: BaseException, status: int, redact: Callable[[str], str]) -> Response:
    return _reply({"error": redact(" ".join(str(exc).split())) or type(exc).__name__}, status)


def _args(*names: str) -> list[str]:
    """The string parameters ``names`` of the request: its query, or for a POST
    its JSON body, which must be an object.

    Raises:
        InvalidConfigError: a parameter is missing or not a string, or a POST
            body is JSON but not an object (a list, a number: a 400, never a 500).
    """
    source = request.get_json(silent=True) if request.method == "POST" else request.args
    if source is not None and not hasattr(source, "get"):
        raise InvalidConfigError(f"the request body must be a JSON object with "
                                 f"{', '.join(names)}, got a {type(source).__name__}")
    values = [(source or {}).get(n) for n in names]
    missing = [n for n, v in zip(names, values, strict=True) if not isinstance(v, str)]
    if missing:
        raise InvalidConfigError(f"missing parameter(s): {', '.join(missing)}")
    return values  # type: ignore[return-value]


def _allowed_hosts(host: str, port_of: Callable[[], int]) -> Callable[[str], bool]:
    """Which ``Host`` headers to accept. Bound to loopback: only loopback names, so a
    page on another site that rebinds its DNS name to 127.0.0.1 is refused."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        return lambda value: True
    names = {"127.0.0.1", "localhost", "[::1]", host}

    def ok(value: str) -> bool:
        name, port = value, ""
        if value.startswith("["):
            end = value.find("]") + 1
            name, port = value[:end], value[end + 1:]
        elif ":" in value:
            name, _, port = value.rpartition(":")
        return name in names and (not port or port == str(port_of()))

    return ok


def create_app(view: StoreView, *, refresh_s: float = 2.0, host: str = "127.0.0.1",
               port_of: Callable[[], int] = lambda: 0) -> Flask:
    """The Flask app serving ``view``.

    Args:
        view: what to show.
        refresh_s: how often an open page polls for new reports (seconds).
        host: the address served; a loopback address restricts ``Host`` headers.
        port_of: the port served (known once the socket is bound).
    """
    app = Flask(__name__, static_folder=None)
    host_ok = _allowed_hosts(host, port_of)

    @app.before_request
    def _check_host() -> Response | None:
        if not host_ok(request.host):
            return _reply({"error": f"unexpected Host header {request.host!r}"}, 421)
        return None

    @app.after_request
    def _headers(resp: Response) -> Response:
        resp.headers["Content-Security-Policy"] = _CSP
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Referrer-Policy"] = "no-referrer"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    @app.errorhandler(InvalidConfigError)
    def _bad_request(exc: InvalidConfigError) -> Response:
        return _error(exc, 400, view.redact)

    @app.errorhandler(CheckpointNotFoundError)
    def _not_found(exc: CheckpointNotFoundError) -> Response:
        return _error(exc, 404, view.redact)

    @app.errorhandler(CheckpointStoreError)
    @app.errorhandler(OSError)
    def _storage_error(exc: Exception) -> Response:
        # An engine's error may quote a credential (a token in a URL): hidden in both.
        logger.warning("ui: %s", view.redact(" ".join(str(exc).split())))
        return _error(exc, 502, view.redact)

    @app.get("/")
    def index() -> Response:
        return send_from_directory(STATIC, "index.html")

    @app.get("/static/<path:name>")
    def static_file(name: str) -> Response:
        # send_from_directory refuses any name resolving outside STATIC.
        return send_from_directory(STATIC, name)

    @app.get("/api/config")
    def config() -> Response:
        return _reply({"uri": view.uri, "kind": view.kind, "refresh_ms": int(refresh_s * 1000)})

    @app.get("/api/overview")
    def overview() -> Response:
        body = json_safe(view.overview(full=request.args.get("full") == "1"))
        # Built to be compared: the overview's cost is the listing, not the reply.
        text = json.dumps(body, allow_nan=False, sort_keys=True)
        return _conditional(hashlib.blake2b(text.encode(), digest_size=8).hexdigest(),
                            lambda: body)

    @app.get("/api/trial")
    def trial() -> Response:
        experiment, trial_name = _args("experiment", "trial")
        since = _number_arg("since", int)
        if since is not None:
            return _reply(view.trial(experiment, trial_name, since=max(since, 0)))
        return _conditional(view.version(experiment, trial_name),
                            lambda: view.trial(experiment, trial_name, since=None))

    @app.get("/api/series")
    def series() -> Response:
        experiment, trial_name, metric = _args("experiment", "trial", "metric")
        x = request.args.get("x") or "training_iteration"
        kwargs = {"x": x, "points": _number_arg("points", int, SERIES_POINTS),
                  "x_min": _number_arg("x_min", float), "x_max": _number_arg("x_max", float)}
        key = repr((view.version(experiment, trial_name), metric, sorted(kwargs.items())))
        return _conditional(hashlib.blake2b(key.encode(), digest_size=8).hexdigest(),
                            lambda: view.series(experiment, trial_name, metric, **kwargs))

    @app.get("/api/csv")
    def csv_export() -> Response:
        (experiment,) = _args("experiment")
        trial_name = request.args.get("trial")
        if trial_name:
            return _csv(view.csv_rows(experiment, trial_name), f"{experiment}-{trial_name}")
        return _csv(view.best_rows(experiment), f"{experiment}-best")

    @app.get("/api/checkpoint")
    def checkpoint() -> Response:
        return _reply(view.checkpoint(*_args("experiment", "trial", "checkpoint")))

    @app.post("/api/verify")
    def verify() -> Response:
        if request.headers.get(VERIFY_HEADER) != "verify":
            return _reply({"error": f"verify needs the {VERIFY_HEADER}: verify header"}, 403)
        return _reply(view.verify(*_args("experiment", "trial", "checkpoint")))

    return app


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``.

    Raises:
        OSError: the port is in use or the address cannot be bound; the
            message names both and says what to do.
    """
    from werkzeug.serving import select_address_family

    family = select_address_family(host, port)
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        err = OSError(f"cannot serve on {host}:{port}: {why}; choose another --port "
                      "(--port 0 picks a free one)")
        err.errno = exc.errno  # one line when printed, the cause still testable
        raise err from None


class Server:
    """The app on a werkzeug server in a background thread (for tests and `ui`).

    Args:
        view: what to show.
        host, port: where to listen; port 0 picks a free port.
        refresh_s: the page's polling interval.
    """

    def __init__(self, view: StoreView, host: str = "127.0.0.1", port: int = 0,
                 refresh_s: float = 2.0):
        from werkzeug.serving import make_server

        self._port = 0
        app = create_app(view, refresh_s=refresh_s, host=host, port_of=lambda: self._port)
        sock = _listen(host, port)
        try:
            # werkzeug binds a port itself only to print two lines and sys.exit(1)
            # when it is busy; a socket we bound raises a plain OSError instead.
            self._server = make_server(host, port, app, threaded=True, fd=sock.fileno())
        finally:
            sock.close()  # werkzeug serves a duplicate of it
        self._port = self._server.server_address[1]
        self.host = host
        self._thread: Any = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"http://{host}:{self._port}/"

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def start(self) -> Server:
        import threading

        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="checkpoint-store-ui")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
