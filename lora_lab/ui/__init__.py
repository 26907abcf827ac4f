"""`lora-lab ui`: a web page over lora-lab's Python API and its `lora-lab run` process
(page.py), bound to 127.0.0.1 unless told otherwise; reachable from elsewhere only with a token.
Needs gradio (lora-lab[ui])."""

from __future__ import annotations

import os

from ..errors import LoraLabError
from ..log import get_logger
from .form import AllowedFolders, needs_token, new_token, token_matches

log = get_logger()


def safety_note(host: str, token: str | None, allowed: AllowedFolders) -> str:
    reach = "reachable from other machines" if needs_token(host) else "reachable from this machine only"
    access = f"Bound to {host}: {reach}" + (", after the token." if token else ".")
    folders = ", ".join(f"`{f}`" for f in allowed.folders)
    return f"{access} Files: only under {folders} (`lora-lab ui --allow DIR`)."


def launch_ui(host: str = "127.0.0.1", port: int = 7860, token: str | None = None, allow: list | None = None) -> None:
    """Serve the page until interrupted. Another host than loopback needs a token: `token`, or
    a new one, printed once."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio as gr
    except ImportError:
        raise LoraLabError("`lora-lab ui` needs gradio: pip install 'lora-lab[ui]'.") from None
    from ..device import gpu_memory_gib
    from .page import Page, build_page

    missing = [folder for folder in allow or [] if not os.path.isdir(os.path.expanduser(folder))]
    if missing:
        raise LoraLabError(f"--allow {missing[0]}: no such folder.")
    allowed = AllowedFolders(allow or ["."])
    if needs_token(host) and not token:
        token = new_token()
        log.info(
            f"--host {host} can be reached from other machines: the page asks for this "
            f"token (any user name):\n  {token}\n(pass --token to choose one)"
        )
    auth = (lambda user, given: token_matches(given, token)) if token else None
    note = safety_note(host, token, allowed)
    log.info(note.replace("`", ""))
    blocks = build_page(Page(allowed, gpu_memory_gib()), note)
    theme = gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
    )  # no font downloads
    blocks.queue().launch(
        server_name=host,
        server_port=port,
        auth=auth,
        theme=theme,
        auth_message="Enter any user name and the token `lora-lab ui` printed when it started." if token else None,
        show_error=True,
        inbrowser=False,
        share=False,
        ssr_mode=False,
    )
