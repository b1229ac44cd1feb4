"""Building and serving the Gradio app: one shared base, the catalog of the runs directory, the engine and session
on top, then the layout, its events and the client API. Gradio is imported only here (lazily)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lorarl.chat.catalog import Catalog, default_base_model
from lorarl.chat.engine import ChatEngine
from lorarl.chat.session import ChatSession
from lorarl.chat.votes import PREFERENCES_FILE, ties_path


def is_loopback(host: str) -> bool:
    """``host`` is this machine only: ``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def host_header_is_loopback(value: str) -> bool:
    """An HTTP ``Host`` header names this machine only: ``localhost`` / a loopback address, with or without a port.

    Example: ``"127.0.0.1:7860"``, ``"localhost"``, ``"[::1]:7860"`` -> True; ``"evil.example:7860"``, ``""`` -> False.
    """
    value = value.strip()
    if value.startswith("["):  # [IPv6]:port
        name = value[1 : value.find("]")] if "]" in value else ""
    else:
        name = value.rsplit(":", 1)[0] if value.count(":") == 1 else value
    return bool(name) and is_loopback(name.lower())


class LoopbackHostOnly:
    """ASGI middleware: a request whose ``Host`` header is not a loopback name is refused (HTTP 403, a WebSocket
    closed with 1008). Binding to 127.0.0.1 keeps other machines out, but not a web page of another site whose name
    its owner re-binds to 127.0.0.1 (DNS rebinding): its requests reach the loopback port with that site's name as
    ``Host``. Gradio itself does not check ``Host``."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            if not host_header_is_loopback(host):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = b"lorarl: this app answers requests for 127.0.0.1 / localhost / [::1] only\n"
                await send(
                    {
                        "type": "http.response.start",
                        "status": 403,
                        "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def check_host(host: str, workbench: bool, share: bool = False) -> None:
    """The workbench starts processes and writes files from the page and has no authentication: it serves on a
    loopback address only, never shared. Raises LorarlError (one line) otherwise; the chat alone may go elsewhere
    (with a warning at launch)."""
    from lorarl.errors import LorarlError

    if workbench and (share or not is_loopback(host)):
        where = "a public share link" if share else f"--host {host}"
        raise LorarlError(
            f"{where}: the workbench launches training processes and has no authentication, so it serves on "
            "127.0.0.1 / localhost / ::1 only; pass --chat-only to serve the chat alone elsewhere"
        )


def make_session(
    runs_dir: str | os.PathLike,
    model: str | None = None,
    shared=None,
    preferences: str | os.PathLike | None = None,
) -> tuple[ChatSession, str]:
    """``(session, base model name)``: ``shared`` (an already loaded :class:`~lorarl.model.SharedBase`) or ``model``
    loaded once (default: the model the runs were trained on, else the embedded default)."""
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    runs = Path(runs_dir).expanduser()
    if shared is None:
        name = model or default_base_model(runs)
        shared = SharedBase.load(ModelConfig(name=name, gradient_checkpointing=False))
    else:
        name = model or shared.cfg.name
    catalog = Catalog(runs, name)
    for line in catalog.skipped:  # (the page's status line says it too)
        print(f"lorarl chat: left out {line}", file=sys.stderr)
    pref_path = Path(preferences) if preferences else catalog.root / PREFERENCES_FILE
    return ChatSession(ChatEngine(shared, catalog), pref_path, ties_path(pref_path)), name


def build_app(
    runs_dir: str | os.PathLike = "runs",
    model: str | None = None,
    shared=None,
    preferences: str | os.PathLike | None = None,
    workbench: bool = False,
    recipe_dirs: list[str | os.PathLike] | None = None,
):
    """The Gradio app (``gr.Blocks``). ``shared``: an already loaded :class:`~lorarl.model.SharedBase` to use;
    else ``model`` (a model name or folder; default: the model the runs were trained on, else the embedded default)
    is loaded once. Votes go to ``preferences`` (default ``RUNS/preferences.jsonl``; ties beside it).
    ``workbench``: the tabs Train, Watch, Chat, Export (:mod:`lorarl.app`) with recipes from the shipped
    ``recipes/`` and ``recipe_dirs`` (:func:`lorarl.app.paths.recipe_folders`); else the chat alone."""
    import gradio as gr

    from lorarl.chat.api import register_api
    from lorarl.chat.handlers import Handlers, wire
    from lorarl.chat.layout import build_layout

    session, name = make_session(runs_dir, model, shared, preferences)
    catalog = session.catalog
    handlers = Handlers(session)
    with gr.Blocks(title="lorarl chat", analytics_enabled=False) as demo:

        def chat():
            return build_layout(name, catalog.choices(), catalog.scorer_choices(), handlers.status_line())

        if workbench:
            from lorarl.app.handlers import build_and_wire
            from lorarl.app.paths import recipe_folders

            widgets = build_and_wire(session, handlers, Path(runs_dir), recipe_folders(recipe_dirs), chat)
        else:
            widgets = chat()
        wire(widgets, handlers)
        register_api(session)
    demo.lorarl_session = session  # for tests and embedding
    return demo


def launch(
    runs_dir: str | os.PathLike = "runs",
    host: str = "127.0.0.1",
    port: int = 7860,
    model: str | None = None,
    share: bool = False,
    shared=None,
    prevent_thread_lock: bool = False,
    quiet: bool = False,
    workbench: bool = False,
    recipe_dirs: list[str | os.PathLike] | None = None,
):
    """Build and serve the app (127.0.0.1 by default: it has no authentication). Returns the app. ``workbench``:
    the Train / Watch / Chat / Export tabs (see :func:`build_app`), served on a loopback address only
    (:func:`check_host`, checked before anything loads)."""
    check_host(host, workbench, share)
    import gradio as gr

    from lorarl.chat.layout import CSS

    css = CSS
    if workbench:
        from lorarl.app.layout import CSS as WORKBENCH_CSS

        css += WORKBENCH_CSS

    if not is_loopback(host) and not quiet:
        print(f"lorarl chat: warning: serving on {host} without authentication; anyone who can reach it can use it")
    demo = build_app(runs_dir, model=model, shared=shared, workbench=workbench, recipe_dirs=recipe_dirs)
    demo.queue(default_concurrency_limit=4)
    system_fonts = ["ui-sans-serif", "system-ui", "sans-serif"]  # no web fonts: the app works offline
    from starlette.middleware import Middleware

    # served on loopback: answer loopback Host names only (DNS rebinding, LoopbackHostOnly)
    app_kwargs = {"middleware": [Middleware(LoopbackHostOnly)]} if is_loopback(host) and not share else None
    demo.launch(
        server_name=host,
        server_port=port,
        share=share,
        app_kwargs=app_kwargs,
        prevent_thread_lock=prevent_thread_lock,
        quiet=quiet,
        theme=gr.themes.Soft(font=system_fonts, font_mono=["ui-monospace", "monospace"]),
        css=css,
        footer_links=["api"],
    )
    return demo
