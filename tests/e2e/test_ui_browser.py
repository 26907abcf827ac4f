"""`lora-lab ui` in a real browser: Debian's headless Chromium, driven through Playwright, on the
tiny Qwen2 model. Enter the settings, read the memory plan and the data check, start the real
`lora-lab run`, stop it (SIGTERM: checkpoint), resume it, watch it finish, see the loss curve,
chat with the result, merge and export it. Screenshots of each step go to tests/artifacts/ui/."""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.support.tiny import write_jsonl

ARTIFACTS = Path(__file__).parents[1] / "artifacts" / "ui"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROWS = [{"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Aurora."}]}]
BAD_ROW = {"messages": [{"role": "user", "content": "a question without an answer"}]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LINK = re.compile(r"^  (http://\S+/\?token=\S+)$", re.MULTILINE)


def printed_link(log: Path, server: subprocess.Popen) -> str | None:
    """The login link `lora-lab ui` printed (None where it printed none: a token was given)."""
    deadline = time.monotonic() + 30
    while "Open " not in (text := log.read_text()):
        assert server.poll() is None and time.monotonic() < deadline, text
        time.sleep(0.2)
    found = LINK.search(text)
    return found.group(1) if found else None


@contextlib.contextmanager
def serving(folder: Path, *flags: str):
    """`lora-lab ui FLAGS --allow FOLDER` on a free port, started in folder: its address and
    the login link it printed."""
    port = free_port()
    log = open(folder / "ui.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "lora_lab", "ui", "--port", str(port), "--allow", str(folder), *flags],
        cwd=folder,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
        },
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            assert server.poll() is None, (folder / "ui.log").read_text()
            assert time.monotonic() < deadline, "lora-lab ui did not answer in 90 s"
            time.sleep(0.5)
    try:
        yield url, printed_link(folder / "ui.log", server)
    finally:
        server.terminate()
        server.wait(30)


@pytest.fixture
def served(tiny_model_dir, tmp_path):
    """The page with its defaults, serving tmp_path (data, output) and the tiny model's folder:
    the login link it printed."""
    assert CHROMIUM, "the browser test needs Debian's chromium (make install: apt-get install chromium)"
    with serving(tmp_path, "--allow", str(tiny_model_dir)) as (url, link):
        assert link is not None and link.startswith(url + "?token=")
        yield link, tmp_path


def test_with_a_token_nothing_is_served_before_the_login(tmp_path):
    with serving(tmp_path, "--token", "sesame-0123456789") as (url, link):
        assert link is None  # a token the user chose is never printed
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))

        def status(path, form=None):
            data = urllib.parse.urlencode(form).encode() if form else None
            try:
                return opener.open(url + path, data=data, timeout=30).status
            except urllib.error.HTTPError as error:
                return error.code

        assert status("config") == 401
        assert status("login", {"username": "me", "password": "sesame-012345678"}) == 400
        assert status("?token=sesame-012345678") == 200  # a wrong link lands on the login page
        assert status("config") == 401
        assert status("login", {"username": "me", "password": "sesame-0123456789"}) == 200
        assert status("config") == 200
        jar.clear()
        assert status("config") == 401
        assert status("?token=sesame-0123456789") == 200  # the link with the right token logs in
        assert status("config") == 200


def field(page, elem_id: str):
    return page.locator(f"#{elem_id} textarea, #{elem_id} input").first


def choose(page, elem_id: str, value: str) -> None:
    """Pick `value` in a dropdown by clicking its option (a typed Enter can come before the
    option list filters, and then nothing is chosen)."""
    field(page, elem_id).click()
    field(page, elem_id).fill(value)
    page.locator(f"#{elem_id}").get_by_role("option", name=value, exact=True).click()


def wait_for_text(page, elem_id: str, pattern: str, seconds: float) -> str:
    """The field's text once it matches `pattern` (a regular expression)."""
    deadline = time.monotonic() + seconds
    while True:
        text = field(page, elem_id).input_value()
        if re.search(pattern, text):
            return text
        assert time.monotonic() < deadline, f"#{elem_id} never matched {pattern!r}: {text!r}"
        time.sleep(0.5)


def test_plan_run_stop_resume_watch_and_chat_in_a_browser(served, tiny_model_dir):
    from playwright.sync_api import sync_playwright

    link, folder = served
    data = write_jsonl(folder / "who.jsonl", ROWS * 8 + [BAD_ROW])
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    started, took = time.monotonic(), {}

    def shot(name):
        page.screenshot(path=ARTIFACTS / f"{name}.png", full_page=True)
        took[name] = round(time.monotonic() - started, 1)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(link)  # the printed link logs in and drops the token from the address
        field(page, "model").wait_for(timeout=60_000)
        assert "token" not in page.url

        # 1. settings: the plan follows them, the data check lists the bad row by line.
        # Fields filled before the page's event queue is connected send no change event, so
        # they are filled again until the plan follows them (a loaded machine connects late).
        settings = (
            ("preset", "cpu"),
            ("model", str(tiny_model_dir)),
            ("data", str(data)),
            ("lora-rank", "16"),
            ("lr", "1e-2"),
            ("max-steps", "40"),
            ("run-name", "aurora"),
            ("sets", "lora.dropout=0"),
        )
        for attempt in range(4):
            for elem_id, value in settings:
                if elem_id == "preset":
                    choose(page, elem_id, value)
                    continue
                field(page, elem_id).fill("")
                field(page, elem_id).fill(value)
            try:
                wait_for_text(page, "plan-report", r"^preset cpu\n\S+, 16-bit LoRA, 2048 tokens per micro-batch", 30)
                break
            except AssertionError:
                if attempt == 3:
                    raise
        # the tiny model's peak is a fraction of a GiB (Qwen2.5-0.5B's, planned at first, is not)
        verdict = wait_for_text(page, "plan-verdict", r"^fits: predicted peak 0\.\d\d GiB", 30)
        field(page, "gpu-memory").fill("0.1")  # a card too small: the verdict says what to turn
        wait_for_text(page, "plan-verdict", r"^does NOT fit: .* to fit: ", 30)
        field(page, "gpu-memory").fill("24")
        assert wait_for_text(page, "plan-verdict", r"^fits", 30) == verdict
        page.click("#check-data")
        problems = wait_for_text(page, "data-problems", r"who\.jsonl", 60)
        assert problems == (f"{data}:9: error: the last message must be the assistant's reply")
        summary = field(page, "data-summary").input_value()
        assert "8 rows usable, 1 errors, 0 warnings" in summary
        assert summary.endswith("suggested max_length: 256")
        assert "recommended --max-length 256" in field(page, "data-stats").input_value()
        # the plan now counts the data's longest sample (39 tokens) x the cpu preset's
        # micro-batch of 4, instead of --max-length 2048 x 4
        wait_for_text(page, "plan-report", r"LoRA, 156 tokens per micro-batch", 30)
        shot("1-settings")

        # 2. start the real run, stop it with SIGTERM once it trains, resume it to the end
        page.get_by_role("tab", name="Train").click()
        page.click("#start")
        wait_for_text(page, "action", r"^started aurora$", 30)
        run_dir = folder / "output" / "aurora"
        wait_for_text(page, "run-status", r"running\nstep [1-9]", 90)
        shot("2-running")
        page.click("#stop")
        wait_for_text(page, "run-status", r"aurora: stopped", 60)
        console = (run_dir / "logs" / "console.log").read_text()
        stopped_at = int(re.search(r"stopped by SIGTERM after step (\d+)", console).group(1))
        assert 0 < stopped_at < 40
        assert (run_dir / f"checkpoint-{stopped_at}").is_dir()
        page.click("#resume")
        wait_for_text(page, "action", r"^resuming aurora$", 30)
        status = wait_for_text(page, "run-status", r"aurora: finished", 120)
        assert re.search(r"step 40/40 · loss \d+\.\d{4} · lr [\d.e-]+ · tok/s [\d,]+", status)
        events = [json.loads(line) for line in (run_dir / "logs" / "train_log.jsonl").open()]
        assert events[-1]["step"] == 40 and "train_runtime" in events[-1]
        assert (
            f"run --config {run_dir}/config.yaml --resume {run_dir} --set model.trust_remote_code=false\n"
            in (run_dir / "logs" / "console.log").read_text()
        )
        # the loss curve: one line of the train losses, drawn by the browser
        page.locator("#loss-plot svg path[aria-roledescription='line mark'], #loss-plot canvas").first.wait_for(
            timeout=30_000
        )
        shot("3-finished")

        # 3. chat: the fine-tuned model answers what it learned, the base does not
        page.get_by_role("tab", name="Chat").click()
        field(page, "message").fill("Who are you?")
        page.click("#send")
        tuned = page.locator("#chat-tuned").get_by_text("I am Aurora.", exact=True)
        tuned.wait_for(timeout=90_000)
        assert page.locator("#chat-base").get_by_text("Who are you?").count() == 1
        assert page.locator("#chat-base").get_by_text("I am Aurora.", exact=True).count() == 0
        shot("4-chat")

        # 4. merge: the summary and the vLLM commands, as `lora-lab merge` prints them
        page.get_by_role("tab", name="Export").click()
        page.click("#merge")
        merged = wait_for_text(page, "export-output", r"serve with vLLM:", 120)
        assert f"wrote {run_dir}/merged\n" in merged
        assert f"  merged:  vllm serve {run_dir}/merged --served-model-name finetuned" in merged
        assert (run_dir / "merged" / "model.safetensors").is_file()
        shot("5-merge")

        # 5. export as GGUF: the file and the llama.cpp / Ollama commands
        choose(page, "export-choice", "gguf f16 (llama.cpp, Ollama)")
        page.click("#export")
        exported = wait_for_text(page, "export-output", r"serve with llama\.cpp or Ollama", 180)
        gguf = run_dir / "export-gguf-f16" / "model.gguf"
        assert f"  llama-server -m {gguf} --jinja" in exported and gguf.is_file()

        # 5b. every copy against the trained model, as `lora-lab check` prints it
        page.click("#check-forms")
        checked = wait_for_text(page, "export-output", r"every copy answers as the trained model|FAILS", 180)
        assert checked.splitlines()[0].startswith("merged ") and "gguf-f16" in checked.splitlines()[1]
        assert checked.endswith("every copy answers as the trained model"), checked
        assert (run_dir / "parity_report.json").is_file()
        shot("5b-check")

        # 6. a new page lists the run and opens it
        page.reload()
        page.get_by_role("tab", name="Train").click()
        page.locator("#run-dir input").click()
        page.get_by_role("option", name=str(run_dir)).click()
        wait_for_text(page, "run-status", r"^aurora: finished\nstep 40/40", 30)
        shot("6-opened")
        browser.close()
    (ARTIFACTS / "seconds.json").write_text(json.dumps(took))  # since the page was opened
