"""`lora-lab ui`: a web page over lora-lab's Python API and its `lora-lab run` process
(page.py), bound to 127.0.0.1 unless told otherwise; reachable from elsewhere only with a token.
Needs gradio (lora-lab[ui])."""

from __future__ import annotations

import os

from ..errors import LoraLabError
from ..log import get_logger
from .form import AllowedFolders, needs_token, new_token

log = get_logger()


def safety_note(host: str, token: str | None, allowed: AllowedFolders) -> str:
    reach = "reachable from other machines" if needs_token(host) else "reachable from this machine only"
    access = f"Bound to {host}: {reach}" + (", after the token." if token else ".")
    folders = ", ".join(f"`{f}`" for f in allowed.folders)
    return f"{access} Files: only under {folders} (`lora-lab ui --allow DIR`)."


def launch_ui(
    host: str = "127.0.0.1",
    port: int = 7860,
    token: str | None = None,
    allow: list | None = None,
    token_file: str | None = None,
    max_runs: int = 1,
) -> None:
    """Serve the page until interrupted. Another host than loopback needs a token (from
    token_file, $LORA_LAB_UI_TOKEN or `token`), or a new one, printed once. Only the host names
    it was started for are served; at most max_runs runs started from it train at once."""
    import tempfile

    from starlette.middleware import Middleware

    from .guard import MAX_UPLOAD, HostGuard, TokenCheck, read_token, served_names

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    uploads = tempfile.mkdtemp(prefix="lora-lab-ui-")  # nothing loads from it; the page refuses paths in it
    os.environ["GRADIO_TEMP_DIR"] = uploads
    if token and not token_file and not os.environ.get("LORA_LAB_UI_TOKEN"):
        log.warning("--token is deprecated: every user sees it in `ps`; use $LORA_LAB_UI_TOKEN or --token-file.")
    token = read_token(token, token_file)
    try:
        import gradio as gr
    except ImportError:
        raise LoraLabError("`lora-lab ui` needs gradio: pip install 'lora-lab[ui]'.") from None
    from ..device import gpu_memory_gib
    from .page import Page, build_page

    missing = [folder for folder in allow or [] if not os.path.isdir(os.path.expanduser(folder))]
    if missing:
        raise LoraLabError(f"--allow {missing[0]}: no such folder.")
    allowed = AllowedFolders(allow or ["."], refused=[uploads])
    if needs_token(host) and not token:
        token = new_token()
        log.info(
            f"--host {host} can be reached from other machines: the page asks for this "
            f"token (any user name):\n  {token}\n(pass --token to choose one)"
        )
    auth = TokenCheck(token) if token else None
    note = safety_note(host, token, allowed)
    log.info(note.replace("`", ""))
    blocks = build_page(Page(allowed, gpu_memory_gib(), max_runs), note)
    theme = gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
    )  # no font downloads
    blocks.queue().launch(
        server_name=host,
        server_port=port,
        auth=auth,
        theme=theme,
        auth_message="Enter any user name and the token `lora-lab ui` printed when it started." if token else None,
        show_error=False,
        max_file_size=MAX_UPLOAD,
        app_kwargs={"middleware": [Middleware(HostGuard, names=served_names(host))]},
        inbrowser=False,
        share=False,
        ssr_mode=False,
    )
