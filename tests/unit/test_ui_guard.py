"""The page's guards, without a server: what the extra-settings box may set, run names, the
PATH#N split, control characters, a run folder's own config.yaml, symbolic links in a run
folder, the Host/Origin check and the pause after wrong tokens."""

import asyncio

import pytest

from lora_lab.config import resolve_config
from lora_lab.errors import LoraLabError
from lora_lab.run_folder import save_config
from lora_lab.run_folder.names import CONFIG_FILE, CONSOLE_LOG
from lora_lab.ui.form import PAGE_SETTABLE, AllowedFolders, RunForm, run_arguments
from lora_lab.ui.guard import HostGuard, TokenCheck, read_token, served_names
from lora_lab.ui.runs import find_runs, read_console
from tests.support.tiny import write_jsonl

ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize(
    "entry",
    [
        "model.trust_remote_code=true",
        "model.name=/elsewhere/model",
        "model.kernels=on",
        "data.datasets=/etc/passwd",
        "data.val_data=/etc/passwd",
        "train.output_dir=/tmp/out",
        "train.run_name=../x",
        "train.resume=/tmp/r",
        "train.from_run=/tmp/r",
        "train.nodes=2",
        "train.main_address=10.0.0.1",
        "train.report_to=wandb",
        "train.disk_check=false",
        "train.allow_config_change=true",
    ],
)
def test_extra_settings_that_load_code_move_files_or_reach_peers_are_refused(entry):
    with pytest.raises(LoraLabError, match="cannot be set from the page"):
        run_arguments(RunForm(model="m", data=["d"], sets=[entry]), "cpu")


def test_allowed_extra_settings_are_config_keys_and_pass():
    config = resolve_config("cpu", flags={"model.name": "qwen2.5-0.5b"}, need_data=False)
    sections = config.to_dict()
    for key in PAGE_SETTABLE:
        section, name = key.split(".")
        assert name in sections[section], key
    argv = run_arguments(RunForm(model="m", data=["d"], sets=["train.weight_decay=0.01"]), "cpu")
    assert argv[-4:] == ["--set", "train.weight_decay=0.01", "--set", "model.trust_remote_code=false"]


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", ".hidden", "..", "a\nb"])
def test_a_run_name_is_one_plain_folder_name(tmp_path, name):
    write_jsonl(tmp_path / "d.jsonl", [ROW])
    form = RunForm(model="qwen2.5-0.5b", data=[str(tmp_path / "d.jsonl")], output_dir=str(tmp_path), run_name=name)
    with pytest.raises(LoraLabError, match="run name"):
        AllowedFolders([tmp_path]).check_form(form)


def test_a_data_line_is_checked_as_lora_lab_reads_it(tmp_path):
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir(), outside.mkdir()
    (inside / "d.jsonl#..").mkdir()
    write_jsonl(inside / "d.jsonl", [ROW])
    write_jsonl(outside / "secret.jsonl", [ROW])
    allowed = AllowedFolders([inside])
    assert allowed.check_data(f"{inside}/d.jsonl#3") == f"{inside}/d.jsonl#3"
    # lora-lab reads `in/d.jsonl#../../../out/secret.jsonl`, a path through the folder `d.jsonl#..`
    with pytest.raises(LoraLabError, match="outside the folders"):
        allowed.check_data(f"{inside}/d.jsonl#../../../out/secret.jsonl#2")


def test_a_control_character_in_a_field_is_refused(tmp_path):
    form = RunForm(model="qwen2.5-0.5b\nstep 9/9", data=["d"], output_dir=str(tmp_path))
    with pytest.raises(LoraLabError, match="model: holds a control character"):
        AllowedFolders([tmp_path]).check_form(form)


def saved_run(folder, **sets):
    data = str(folder.parent / "d.jsonl")
    config = resolve_config("cpu", flags={"model.name": "qwen2.5-0.5b", "data.datasets": [data]}, need_data=False)
    config = config.with_changes({key.replace("__", "."): value for key, value in sets.items()}, "test")
    folder.mkdir(parents=True)
    save_config(config, folder / CONFIG_FILE)
    return folder


def test_a_run_whose_config_turns_on_model_code_or_reads_outside_is_refused(tmp_path):
    allowed = AllowedFolders([tmp_path / "work"])
    allowed.check_saved_run(saved_run(tmp_path / "work" / "ok"))
    with pytest.raises(LoraLabError, match="trust_remote_code: true; the page never runs"):
        allowed.check_saved_run(saved_run(tmp_path / "work" / "code", model__trust_remote_code=True))
    with pytest.raises(LoraLabError, match="model: .* is outside"):
        allowed.check_saved_run(saved_run(tmp_path / "work" / "far", model__name=str(tmp_path / "elsewhere")))
    with pytest.raises(LoraLabError, match="data: .* is outside"):
        allowed.check_saved_run(saved_run(tmp_path / "work" / "data", data__datasets=["/etc/passwd"]))
    with pytest.raises(LoraLabError, match="reports to"):
        allowed.check_saved_run(saved_run(tmp_path / "work" / "wandb", train__report_to=["wandb"]))
    with pytest.raises(LoraLabError, match="train.main_address"):
        allowed.check_saved_run(saved_run(tmp_path / "work" / "peer", train__main_address="10.0.0.1"))


def test_links_in_a_run_folder_are_not_followed(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    run = saved_run(tmp_path / "out" / "r")
    (run / "logs").mkdir()
    (run / CONSOLE_LOG).symlink_to(secret)
    assert read_console(run) == ""
    (tmp_path / "out" / "linked").symlink_to(run)
    assert find_runs([tmp_path / "out"]) == [run]


def test_the_upload_folder_is_refused_inside_an_allowed_one(tmp_path):
    (tmp_path / "uploads").mkdir()
    allowed = AllowedFolders([tmp_path], refused=[tmp_path / "uploads"])
    assert allowed.contains(tmp_path / "d.jsonl") and not allowed.contains(tmp_path / "uploads" / "m")


def ask(guard, method="GET", path="/", **headers):
    sent = []

    async def app(scope, receive, send):
        sent.append("app")

    async def send(message):
        sent.append(message)

    guard.app = app
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(guard(scope, None, send))
    return "app" if sent == ["app"] else sent[0]["status"]


def test_only_the_started_host_names_and_their_own_origin_are_served():
    guard = HostGuard(None, served_names("127.0.0.1"))
    assert ask(guard, host="127.0.0.1:7860") == "app"
    assert ask(guard, host="localhost:7860") == "app"
    assert ask(guard, host="evil.example:7860") == 403  # DNS rebinding
    assert ask(guard) == 403  # no Host at all
    assert ask(guard, "POST", "/gradio_api/queue/join", host="127.0.0.1:7860", origin="http://127.0.0.1:7860") == "app"
    assert ask(guard, "POST", "/gradio_api/queue/join", host="127.0.0.1:7860", origin="http://evil.example") == 403
    assert ask(guard, "POST", "/gradio_api/upload", host="127.0.0.1:7860") == 403
    named = HostGuard(None, served_names("lab.example.org"))
    assert ask(named, host="lab.example.org:7860") == "app" and ask(named, host="other.org") == 403


def test_wrong_tokens_are_paused_after_a_few():
    now = [0.0]
    check = TokenCheck("right-token", per_minute=3, clock=lambda: now[0])
    assert check("u", "right-token")
    assert not any(check("u", "wrong") for _ in range(3))
    assert not check("u", "right-token")  # paused, even the right one
    now[0] = 61.0
    assert check("u", "right-token")


def test_the_token_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    (tmp_path / "t").write_text("from-file\n")
    monkeypatch.setenv("LORA_LAB_UI_TOKEN", "from-env")
    assert read_token("from-argv", str(tmp_path / "t")) == "from-file"
    assert read_token("from-argv", None) == "from-env"
    monkeypatch.delenv("LORA_LAB_UI_TOKEN")
    assert read_token("from-argv", None) == "from-argv"
    with pytest.raises(LoraLabError, match="--token-file .*: cannot read it"):
        read_token(None, str(tmp_path / "missing"))
