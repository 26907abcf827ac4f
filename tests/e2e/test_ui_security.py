"""The attacks of issue 46 against a real `lora-lab ui` on 127.0.0.1, started with its defaults
(one page process for the whole module), through a real HTTP client: another account of the
machine, without the token, gets nothing; with the token (the printed link), each attack is
refused, and nothing runs or is written outside the allowed folder."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lora_lab.config import resolve_config
from lora_lab.run_folder import save_config
from lora_lab.run_folder.names import CONFIG_FILE, CONSOLE_LOG, LOCK_FILE
from tests.e2e.test_ui_browser import free_port, printed_link
from tests.support.tiny import write_jsonl

ROWS = [{"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Aurora."}]}]
EVIL_CODE = "from pathlib import Path\nPath({marker!r}).write_text('code ran')\n"


class Served:
    def __init__(self, url: str, link: str, work: Path, outside: Path, marker: Path):
        self.url, self.link, self.work, self.outside, self.marker = url, link, work, outside, marker
        self.client = httpx.Client(base_url=url, timeout=60)
        assert self.client.get(link, follow_redirects=True).status_code == 200  # logged in

    def form(self, **given) -> list:
        """The page's form values in page.FORM_FIELDS order."""
        values = {
            "model": "qwen2.5-0.5b",
            "preset": "auto",
            "data": str(self.work / "d.jsonl"),
            "lora_rank": "",
            "lora_alpha": "",
            "max_length": "",
            "micro_batch_size": "",
            "grad_accum": "",
            "lr": "",
            "epochs": "",
            "max_steps": "1",
            "qlora": False,
            "output_dir": str(self.work / "output"),
            "run_name": "r",
            "sets": "",
        }
        values.update(given)
        return list(values.values())

    def call(self, api: str, data: list, **headers):
        """An API call the way the page's buttons make it: its outputs, or the HTTP status of a refusal."""
        posted = self.client.post(f"/gradio_api/call/{api}", json={"data": data}, headers=headers)
        if posted.status_code != 200:
            return posted.status_code
        answer = self.client.get(f"/gradio_api/call/{api}/{posted.json()['event_id']}").text
        event = answer.split("event: ")[-1]
        assert event.startswith("complete"), answer
        return json.loads(event.split("data: ", 1)[1])

    def outside_is_untouched(self):
        assert sorted(p.name for p in self.outside.iterdir()) == ["secret.jsonl", "secret.txt"]
        assert not self.marker.exists()


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-security")
    work, outside = root / "work", root / "outside"
    work.mkdir(), outside.mkdir()
    write_jsonl(work / "d.jsonl", ROWS)
    (work / "d.jsonl#..").mkdir()  # the folder a `#` escape passes through
    write_jsonl(outside / "secret.jsonl", ROWS)
    (outside / "secret.txt").write_text("the secret")
    marker = root / "code-ran"
    evil = work / "evil-model"
    shutil.copytree(tiny_model_dir, evil)
    config = json.loads((evil / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (evil / "config.json").write_text(json.dumps(config))
    (evil / "evil.py").write_text(EVIL_CODE.format(marker=str(marker)))
    port = free_port()
    log = open(root / "ui.log", "wb")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("LORA_LAB_UI_TOKEN", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "lora_lab", "ui", "--port", str(port), "--allow", str(work)],
        cwd=work,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            httpx.get(url + "/", timeout=2)
            break
        except httpx.HTTPError:
            assert server.poll() is None, (root / "ui.log").read_text()
            assert time.monotonic() < deadline, "lora-lab ui did not answer in 90 s"
            time.sleep(0.5)
    try:
        link = printed_link(root / "ui.log", server)
        assert link is not None and link.startswith(url + "/?token=")
        yield Served(url, link, work, outside, marker)
    finally:
        server.terminate()
        server.wait(30)


def test_without_the_token_another_account_gets_nothing(served):
    """Anyone who can reach 127.0.0.1 (every account of the machine) but lacks the token."""
    other = httpx.Client(base_url=served.url, timeout=60)
    assert other.get("/config").status_code == 401
    assert other.post("/gradio_api/call/start", json={"data": served.form()}).status_code == 401
    assert other.get(served.link.replace("token=", "token=x"), follow_redirects=True).status_code == 200
    assert other.get("/config").status_code == 401  # a wrong link logged nobody in
    assert not other.cookies
    assert not (served.work / "output").exists()
    served.outside_is_untouched()


def test_a_foreign_host_name_is_refused(served):
    """DNS rebinding: a site whose name now points at 127.0.0.1 sends its own Host."""
    assert httpx.get(served.url + "/", headers={"Host": "attacker.example:7860"}).status_code == 403
    assert served.call("start", served.form(), Host="attacker.example") == 403
    assert (
        httpx.get(served.url + "/", headers={"Host": f"localhost:{served.url.rsplit(':', 1)[1]}"}).status_code == 200
    )
    assert not (served.work / "output").exists()


def test_a_cross_site_post_is_refused(served):
    assert served.call("start", served.form(), Origin="https://attacker.example") == 403
    assert served.call("plan", [24, None, *served.form()], Origin=served.url)[0].startswith(("fits", "does NOT"))
    assert not (served.work / "output").exists()


@pytest.mark.parametrize(
    "entry",
    [
        "model.trust_remote_code=true",
        "train.output_dir={outside}",
        "data.datasets={outside}/secret.jsonl",
        "train.resume={outside}",
        "train.from_run={outside}",
        "train.nodes=2",
        "train.main_address=10.0.0.1",
        "train.report_to=wandb",
    ],
)
def test_smuggled_settings_are_refused(served, entry):
    answer = served.call("start", served.form(sets=entry.format(outside=served.outside)))
    assert "cannot be set from the page" in answer[1]
    assert not (served.work / "output").exists()
    served.outside_is_untouched()


@pytest.mark.parametrize("size", [100, 2_000_000])
def test_uploads_are_refused_even_a_model_with_auto_map(served, size):
    files = [
        ("files", ("evil.py", b"import os\n" + b"#" * size)),
        ("files", ("config.json", json.dumps({"auto_map": {"AutoModel": "evil.Model"}}).encode())),
    ]
    answer = served.client.post("/gradio_api/upload", files=files)
    assert answer.status_code == 403 and "takes no uploads" in answer.text
    served.outside_is_untouched()


@pytest.mark.parametrize("name", ["../../outside/x", "{outside}/x", "a/../../../outside/x"])
def test_a_run_name_cannot_leave_the_output_folder(served, name):
    answer = served.call("start", served.form(run_name=name.format(outside=served.outside)))
    assert answer[1].startswith("not started: run name:")
    served.outside_is_untouched()


def test_a_hash_in_a_data_line_cannot_reach_outside(served):
    escape = f"{served.work}/d.jsonl#../../../outside/secret.jsonl#2"  # lora-lab reads up to the last #N
    assert "outside the folders" in served.call("start", served.form(data=escape))[1]
    assert "outside the folders" in served.call("check_data", served.form(data=escape))[0]
    served.outside_is_untouched()


def planted_run(served: Served, name: str, **model) -> Path:
    run = served.work / "planted" / name
    run.mkdir(parents=True)
    config = resolve_config(
        "cpu", flags={"model.name": str(served.work / "evil-model"), "data.datasets": [str(served.work / "d.jsonl")]}
    )
    config = config.with_changes({f"model.{key}": value for key, value in model.items()}, "test")
    save_config(config, run / CONFIG_FILE)
    return run


def test_stop_does_not_signal_the_process_a_planted_lock_names(served):
    run = planted_run(served, "locked")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (run / LOCK_FILE).write_text(json.dumps({"pid": victim.pid, "host": socket.gethostname(), "started": "x"}))
        answer = served.call("stop", [str(run)])
        assert f"names process {victim.pid}, which is not a `lora-lab run`" in answer[0]
        time.sleep(0.3)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait(30)


def test_a_linked_console_log_is_not_shown(served):
    run = planted_run(served, "linked")
    (run / "logs").mkdir()
    (run / CONSOLE_LOG).symlink_to(served.outside / "secret.txt")
    status, _, console = served.call("watch", [str(run)])
    assert status.startswith("linked:") and console == ""
    assert "the secret" not in json.dumps(served.call("watch", [str(run)]))


def test_a_run_config_with_remote_code_is_refused_by_chat_merge_export_and_resume(served):
    run = planted_run(served, "code", trust_remote_code=True)
    refused = "trust_remote_code: true; the page never runs a model's own code"
    assert refused in served.call("merge", [str(run)])[0]
    assert refused in served.call("export", [str(run), "gguf f16 (llama.cpp, Ollama)"])[0]
    assert refused in served.call("resume", [str(run)])[0]
    chat = served.call("send", [str(run), "hi", [], [], 8])
    assert refused in json.dumps(chat[0][-1]["content"])
    served.outside_is_untouched()


def test_a_run_from_the_page_never_runs_model_code_and_runs_one_at_a_time(served):
    """The model folder ships code (auto_map): the run starts with remote code off and refuses
    it; a second run while the first is under way is refused."""
    answer = served.call("start", served.form(model=str(served.work / "evil-model"), run_name="evil"))
    assert answer[1] == "started evil"
    second = served.call("start", served.form(run_name="second"))
    assert "at most 1 at once" in second[1]
    run = served.work / "output" / "evil"
    deadline = time.monotonic() + 120
    while (status := served.call("watch", [str(run)])[0]).startswith("evil: running"):
        assert time.monotonic() < deadline, status
        time.sleep(1)
    console = (run / CONSOLE_LOG).read_text()
    assert "--set model.trust_remote_code=false" in console.splitlines()[0]
    assert "ships its own Python code" in console
    assert not (served.work / "output" / "second").exists()
    served.outside_is_untouched()
