"""`lora-lab ui`: a web page over lora-lab's Python API and its `lora-lab run` process
(page.py), bound to 127.0.0.1 unless told otherwise; it asks for a token (a new one comes in a
printed login link) unless started with --no-token on loopback. Needs gradio (lora-lab[ui])."""

from __future__ import annotations

import os

from ..errors import LoraLabError
from ..log import get_logger
from .form import AllowedFolders, new_token, reachable_from_elsewhere

log = get_logger()


def safety_note(host: str, token: str | None, allowed: AllowedFolders) -> str:
    reach = "reachable from other machines" if reachable_from_elsewhere(host) else "reachable from this machine only"
    access = f"Bound to {host}: {reach}" + (", after the token." if token else ", by every account of it.")
    folders = ", ".join(f"`{f}`" for f in allowed.folders)
    return f"{access} Files: only under {folders} (`lora-lab ui --allow DIR`)."


def page_token(host: str, token: str | None, token_file: str | None, no_token: bool) -> tuple[str | None, bool]:
    """The token the page asks for, and whether it is new (then `lora-lab ui` prints its link):
    --token-file, $LORA_LAB_UI_TOKEN or --token, else a new one; none only with --no-token on
    a loopback address."""
    from .guard import TOKEN_ENV, read_token

    if token and not token_file and not os.environ.get(TOKEN_ENV):
        log.warning("--token is deprecated: every user sees it in `ps`; use $LORA_LAB_UI_TOKEN or --token-file.")
    given = read_token(token, token_file)
    if no_token:
        if reachable_from_elsewhere(host):
            raise LoraLabError(
                f"--no-token: the page on --host {host} could be used from other machines without a token; "
                "drop --no-token (a token is made and printed), or serve on 127.0.0.1."
            )
        if given:
            raise LoraLabError(
                "--no-token: a token was given as well (--token, --token-file or $LORA_LAB_UI_TOKEN); drop one."
            )
        return None, False
    return (given, False) if given else (new_token(), True)


def launch_ui(
    *,
    host: str = "127.0.0.1",
    port: int = 7860,
    token: str | None = None,
    allow: list | None = None,
    token_file: str | None = None,
    max_runs: int = 1,
    no_token: bool = False,
) -> None:
    """Serve the page until interrupted. It asks for a token (from token_file,
    $LORA_LAB_UI_TOKEN or `token`, else a new one whose login link is printed once), unless
    no_token on a loopback address. Only the host names it was started for are served; at most
    max_runs runs started from it train at once."""
    import tempfile

    from starlette.middleware import Middleware

    from .guard import MAX_UPLOAD, HostGuard, TokenCheck, TokenLink, served_names

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    token, new = page_token(host, token, token_file, no_token)
    try:
        import gradio as gr
    except ImportError:
        raise LoraLabError("`lora-lab ui` needs gradio: pip install 'lora-lab[ui]'.") from None
    from ..device import gpu_memory_gib
    from .page import Page, build_page

    missing = [folder for folder in allow or [] if not os.path.isdir(os.path.expanduser(folder))]
    if missing:
        raise LoraLabError(f"--allow {missing[0]}: no such folder.")
    uploads = tempfile.mkdtemp(prefix="lora-lab-ui-")  # nothing loads from it; the page refuses paths in it
    os.environ["GRADIO_TEMP_DIR"] = uploads
    allowed = AllowedFolders(allow or ["."], refused=[uploads])
    note = safety_note(host, token, allowed)
    log.info(note.replace("`", ""))
    blocks = build_page(Page(allowed, gpu_memory_gib(), max_runs), note)
    theme = gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
    )  # no font downloads
    middleware = [Middleware(HostGuard, names=served_names(host))] + ([Middleware(TokenLink)] if token else [])
    blocks.queue().launch(
        server_name=host,
        server_port=port,
        auth=TokenCheck(token) if token else None,
        theme=theme,
        auth_message="Enter any user name and the token of `lora-lab ui` (its printed link logs you in)."
        if token
        else None,
        show_error=False,
        max_file_size=MAX_UPLOAD,
        app_kwargs={"middleware": middleware},
        inbrowser=False,
        share=False,
        ssr_mode=False,
        prevent_thread_lock=True,
    )
    log.info(opening_line(host, blocks.server_port, token, new))
    blocks.block_thread()


def opening_line(host: str, port: int, token: str | None, new: bool) -> str:
    """How to open the page: a new token's login link (printed only here), or the address."""
    from .guard import login_link, page_address

    if token is None:
        return f"Open {page_address(host, port)}: no token asked (--no-token)."
    if new:
        link = login_link(host, port, token)
        return f"Open the page, logged in, with this link (its token is new and printed only here):\n  {link}"
    return f"Open {page_address(host, port)} and log in with your token (any user name)."
