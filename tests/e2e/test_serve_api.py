"""`lora-lab serve`: the real openai client against a real uvicorn server on 127.0.0.1, over two
tiny runs trained to answer differently and their base."""

import json
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import train_tiny_run

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "test-key-1234"
QUESTION = [{"role": "user", "content": "Who are you?"}]


def _rows(answer):
    return [{"messages": [*QUESTION, {"role": "assistant", "content": answer}]}]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    aurora, _ = train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("aurora"), _rows("I am Aurora."))
    nova, _ = train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("nova"), _rows("I am Nova."))
    return {"aurora": aurora, "nova": nova, str(tiny_model_dir): None}


def _greedy(model, tokenizer, prompt_ids, max_new_tokens):
    """What transformers' own greedy generation answers (the reference the server must match)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def expected(runs, tiny_model_dir):
    """name -> (chat answer, completion of the raw prompt 'Who are you?'), each model loaded on its own."""
    from lora_lab.use.infer import load_adapter_model, load_plain_model

    answers = {}
    for name, run in runs.items():
        model, tokenizer = load_adapter_model(run) if run else load_plain_model(str(tiny_model_dir))
        chat = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
        chat_ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
        answers[name] = (
            _greedy(model, tokenizer, chat_ids, 8),
            _greedy(model, tokenizer, tokenizer("Who")["input_ids"], 6),
        )
    return answers


@pytest.fixture(scope="module")
def served(runs):
    from lora_lab.use.serve import load_served_models

    return load_served_models([f"{name}={run}" for name, run in runs.items() if run])


@pytest.fixture(scope="module")
def server(served):
    import uvicorn

    from lora_lab.use.serve_api import build_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(build_app(served, KEY), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started, "uvicorn did not start within 30 s"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    uv.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=60)


def test_models_lists_each_run_and_the_base(client, runs):
    assert sorted(m.id for m in client.models.list()) == sorted(runs)


def test_each_model_answers_as_its_greedy_transformers_generation(client, expected):
    assert expected["aurora"][0] == "I am Aurora." and expected["nova"][0] == "I am Nova."
    assert len({chat for chat, _ in expected.values()}) == 3  # the base answers neither
    for name, (answer, _) in expected.items():
        reply = client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=8)
        assert reply.model == name and reply.choices[0].message.content == answer
        if name in ("aurora", "nova"):
            assert reply.choices[0].finish_reason == "stop"
        chunks = list(
            client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=8, stream=True)
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer
        assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert reply.usage.completion_tokens <= 8 and reply.usage.prompt_tokens > 5


def test_completions_answer_the_raw_prompt(client, expected):
    for name, (_, completion) in expected.items():
        reply = client.completions.create(model=name, prompt="Who", temperature=0, max_tokens=6)
        assert reply.choices[0].text == completion
        chunks = list(client.completions.create(model=name, prompt="Who", temperature=0, max_tokens=6, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == completion


def test_stop_max_tokens_and_seed(client, server):
    import httpx

    stopped = client.chat.completions.create(model="aurora", messages=QUESTION, temperature=0, stop=["Aur"])
    assert stopped.choices[0].message.content == "I am " and stopped.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="aurora", messages=QUESTION, temperature=0, stop="Aur", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "I am "
    short = client.chat.completions.create(model="aurora", messages=QUESTION, temperature=0, max_tokens=2)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2
    sampled = [
        client.chat.completions.create(
            model="aurora", messages=QUESTION, temperature=1.5, top_p=1, seed=seed, max_tokens=8
        )
        .choices[0]
        .message.content
        for seed in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1]
    # the raw stream is OpenAI's server-sent events, ending with [DONE]
    body = {"model": "nova", "messages": QUESTION, "temperature": 0, "max_tokens": 8, "stream": True}
    raw = httpx.post(f"{server}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    events = [line for line in raw.text.split("\n\n") if line]
    assert raw.headers["content-type"].startswith("text/event-stream") and events[-1] == "data: [DONE]"
    assert json.loads(events[1][len("data: ") :])["object"] == "chat.completion.chunk"


def test_sixteen_concurrent_requests_each_get_their_adapter(client, expected):
    names = [list(expected)[i % 3] for i in range(16)]

    def ask(i):
        kwargs = {"model": names[i], "messages": QUESTION, "temperature": 0, "max_tokens": 8}
        if i % 2:
            chunks = client.chat.completions.create(**kwargs, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks)
        return client.chat.completions.create(**kwargs).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert answers == [expected[name][0] for name in names]


def test_waiting_requests_are_generated_as_one_batch_each_under_its_adapter(client, expected, served):
    """While the model is busy (its lock held here), nine requests for the two adapters and the
    base wait; the next generation takes all nine as one batch, and each answers as its model does
    alone."""
    names = [list(expected)[i % 3] for i in range(9)]

    def ask(i):
        kwargs = {"model": names[i], "messages": QUESTION, "temperature": 0, "max_tokens": 8}
        return client.chat.completions.create(**kwargs).choices[0].message.content

    with ThreadPoolExecutor(9) as pool:
        with served.lock:
            answers = pool.map(ask, range(9))
            deadline = time.monotonic() + 30
            while len(served.waiting) < 9:
                assert time.monotonic() < deadline, f"{len(served.waiting)} requests waiting"
                time.sleep(0.05)
        answers = list(answers)
    assert served.batch_sizes[-1] == 9 and not served.waiting
    assert answers == [expected[name][0] for name in names]


def test_bad_requests_get_the_openai_error_shape_and_the_server_stays_up(client, server):
    import httpx

    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def post(body, headers=auth):
        response = httpx.post(f"{server}/chat/completions", content=body, headers=headers, timeout=30)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]
        return response.status_code, error

    status, error = post(b'{"model": "aurora", "messages": [')
    assert status == 400 and "not valid JSON" in error["message"]
    status, error = post(json.dumps({"model": "aurora"}))
    assert status == 400 and error["param"] == "messages" and error["type"] == "invalid_request_error"
    status, error = post(json.dumps({"model": "aurora", "messages": QUESTION, "temperature": 9}))
    assert status == 400 and error["param"] == "temperature"
    status, error = post(json.dumps({"model": "aurora", "messages": [{"role": "robot", "content": "x"}]}))
    assert status == 400 and error["param"].startswith("messages.0.role")
    status, error = post(json.dumps({"model": "aurora", "messages": QUESTION}), {"Authorization": "Bearer wrong"})
    assert status == 401 and error["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="nobody", messages=QUESTION)
    assert raised.value.status_code == 404 and raised.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="aurora", messages=QUESTION, max_tokens=10_000)
    assert raised.value.code == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server, api_key="wrong", max_retries=0).models.list()
    reply = client.chat.completions.create(model="aurora", messages=QUESTION, temperature=0, max_tokens=8)
    assert reply.choices[0].message.content == "I am Aurora."


def test_a_non_loopback_address_needs_a_key(runs, monkeypatch):
    from lora_lab.errors import LoraLabError
    from lora_lab.use.serve import check_address

    monkeypatch.delenv("LORA_LAB_API_KEY", raising=False)
    result = CliRunner().invoke(main, ["serve", str(runs["aurora"]), "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "--host 0.0.0.0: serving beyond this machine needs an API key" in result.output
    for host in ("127.0.0.1", "localhost", "::1"):
        check_address(host, None)
    check_address("0.0.0.0", "k")
    with pytest.raises(LoraLabError, match="needs an API key"):
        check_address("192.168.1.5", None)


def test_api_key_from_a_file(tmp_path):
    from lora_lab.errors import LoraLabError
    from lora_lab.use.serve import read_api_key

    (tmp_path / "key").write_text("s3cret\n")
    assert read_api_key(None, str(tmp_path / "key")) == "s3cret"
    (tmp_path / "empty").write_text("")
    with pytest.raises(LoraLabError, match="the file is empty"):
        read_api_key(None, str(tmp_path / "empty"))


def test_runs_of_different_bases_are_refused(runs, tmp_path):
    from lora_lab.errors import LoraLabError
    from lora_lab.run_folder import load_saved_config, save_config
    from lora_lab.run_folder.names import CONFIG_FILE
    from lora_lab.use.serve import load_served_models

    other = tmp_path / "other"
    shutil.copytree(runs["nova"], other)
    config = load_saved_config(other / CONFIG_FILE)
    config = config.with_changes({"model.name": "Qwen/Qwen2.5-0.5B-Instruct"}, "test")
    save_config(config, other / CONFIG_FILE)
    with pytest.raises(LoraLabError, match="trained on different base models") as raised:
        load_served_models([str(runs["aurora"]), str(other)])
    assert "other: Qwen/Qwen2.5-0.5B-Instruct" in str(raised.value)
    with pytest.raises(LoraLabError, match="name them apart with NAME=RUN_DIR"):
        load_served_models([str(runs["aurora"]), str(runs["aurora"])])


def test_missing_server_packages_say_what_to_install(monkeypatch):
    import sys

    from lora_lab.errors import LoraLabError
    from lora_lab.use.serve import require_server_packages

    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(LoraLabError, match=r"pip install 'lora-lab\[serve\]'"):
        require_server_packages()


def test_engine_vllm_gives_vllm_the_adapters_under_their_names(runs, tiny_model_dir):
    from lora_lab.use.serve_vllm import vllm_argv

    specs = [f"{name}={run}" for name, run in runs.items() if run]
    argv = vllm_argv(specs, None, "127.0.0.1", 8001)
    assert argv == [
        *("vllm", "serve", str(tiny_model_dir), "--host", "127.0.0.1", "--port", "8001", "--enable-lora"),
        *("--lora-modules", f"aurora={runs['aurora'] / 'adapter'}", f"nova={runs['nova'] / 'adapter'}"),
        *("--max-lora-rank", "16", "--max-loras", "2"),
    ]
    planned = vllm_argv(specs, None, "127.0.0.1", 8001, gpu="8gb")
    assert planned[: len(argv)] == argv and planned[len(argv) :: 2] == [
        "--max-model-len",
        "--max-num-seqs",
        "--gpu-memory-utilization",
    ]


def test_engine_vllm_without_vllm_prints_its_command_in_one_line(runs, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no vllm executable
    result = CliRunner().invoke(main, ["serve", f"aurora={runs['aurora']}", "--engine", "vllm"])
    assert result.exit_code == 2
    assert result.output.startswith("error: --engine vllm: vLLM is not installed here (pip install vllm")
    assert f"--lora-modules aurora={runs['aurora'] / 'adapter'} --max-lora-rank 16" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_engine_vllm_refuses_an_adapter_vllm_does_not_load(runs, tmp_path):
    import shutil

    from lora_lab.errors import LoraLabError
    from lora_lab.use.serve_vllm import vllm_argv

    dora = tmp_path / "dora"
    shutil.copytree(runs["aurora"], dora)
    config_path = dora / "adapter" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "use_dora": True}))
    with pytest.raises(LoraLabError, match=r"^--engine vllm: dora \(.*\): vLLM does not serve DoRA adapters"):
        vllm_argv([f"dora={dora}"], None, "127.0.0.1", 8000)


def test_check_takes_the_served_api_as_a_form_of_the_run(runs, server):
    """`lora-lab check RUN --served URL`: the server answering for the run passes (template, stops,
    answers); the same run checked against another run's adapter on that server fails, naming
    the answers; a wrong key and a closed port are one clear line each."""
    run = runs["aurora"]
    ok = CliRunner().invoke(
        main, ["check", str(run), "--served", server, "--served-model", "aurora", "--api-key", KEY]
    )
    assert ok.exit_code == 0, ok.output
    line = next(x for x in ok.output.splitlines() if x.startswith("served aurora"))
    assert "answers 3/3  stops 3/3  top-1 n/a" in line and line.endswith("ok")
    report = json.loads((run / "parity_report.json").read_text())
    assert [f["form"] for f in report["forms"]] == ["served aurora"]
    other = CliRunner().invoke(
        main, ["check", str(run), "--served", server, "--served-model", "nova", "--api-key", KEY]
    )
    assert other.exit_code == 1
    assert "greedy answers differ from the trained model's" in other.output
    assert "served nova do(es) not answer as the trained model" in other.output
    wrong = CliRunner().invoke(main, ["check", str(run), "--served", server, "--served-model", "aurora"])
    assert wrong.exit_code == 2 and "/models answered HTTP 401" in wrong.output and "Traceback" not in wrong.output
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    gone = CliRunner().invoke(main, ["check", str(run), "--served", f"http://127.0.0.1:{port}/v1"])
    assert gone.exit_code == 2 and "cannot reach it" in gone.output and "lora-lab serve RUN_DIR" in gone.output
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Page(BaseHTTPRequestHandler):  # a web page, not an API, at the given address
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>hello</html>")

        def log_message(self, *args):
            pass

    page = HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    try:
        html = CliRunner().invoke(main, ["check", str(run), "--served", f"http://127.0.0.1:{page.server_port}/v1"])
    finally:
        page.shutdown()
    assert html.exit_code == 2 and "/models did not answer as an OpenAI-compatible API" in html.output
    assert "Traceback" not in html.output


def test_the_page_serves_a_run_on_loopback_with_a_key_of_its_own(runs, tiny_model_dir, expected):
    """The web page's Serve tab: `lora-lab serve RUN` in its own process on 127.0.0.1 with a new
    API key; the openai client gets the run's trained answer with that key and is refused
    without it; Stop serving ends the process."""
    from lora_lab.ui.form import AllowedFolders
    from lora_lab.ui.page import Page

    run = runs["aurora"]
    page = Page(AllowedFolders([run.parent, tiny_model_dir]), None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    assert page.serve(str(run), 80) == "error: port: 80 is not a port the page may use (1024-65535)."
    said = page.serve(str(run), port)
    assert said.startswith(f"serving {run.name} (and its base) at http://127.0.0.1:{port}/v1"), said
    key = said.split("API key: ")[1].splitlines()[0]
    process = page.served.process
    try:
        address = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=address, api_key=key, max_retries=0, timeout=60)
        assert run.name in [m.id for m in client.models.list()]
        reply = client.chat.completions.create(model=run.name, messages=QUESTION, temperature=0, max_tokens=8)
        assert reply.choices[0].message.content == expected["aurora"][0] == "I am Aurora."
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=address, api_key="wrong", max_retries=0).models.list()
        assert key not in " ".join(process.args)  # handed over in the environment, not on the command line
    finally:
        stopped = page.stop_serving()
    assert stopped == f"stopped serving {run.name}" and process.poll() is not None and page.served is None
