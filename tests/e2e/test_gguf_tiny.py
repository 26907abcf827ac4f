"""lora-lab export --format gguf on a tiny model trained by `lora-lab run`: the run is merged,
converted by llama.cpp's convert_hf_to_gguf.py, loaded back by a real llama.cpp (the
llama-cpp-python binding), and llama.cpp answers the trained question as the run does."""

import json

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import train_tiny_run

pytest.importorskip("llama_cpp", reason="--format gguf needs llama-cpp-python (lora-lab[gguf])")
ROWS = [{"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Aurora."}]}]


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def llama_cpp_answer(gguf, question: str, max_tokens: int = 24) -> str:
    """Greedy chat completion by llama.cpp, with the chat template and eos from the GGUF."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=512, verbose=False, seed=0)
    reply = llm.create_chat_completion([{"role": "user", "content": question}], temperature=0.0, max_tokens=max_tokens)
    return reply["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    return train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("gguf"), ROWS)


def stage_lines(output: str) -> list[str]:
    """The export's stage and progress lines: llama.cpp's own logs are not among them."""
    assert "INFO:hf-to-gguf" not in output and "llama_model_loader" not in output
    return [line for line in output.splitlines() if line.startswith(("GGUF ", "  "))]


def quarters(tool: str, what: str) -> list[str]:
    """A progress line at each quarter of the tiny Qwen2's 26 tensors."""
    return [f"  {tool}: {done}/26 {what}" for done in (7, 13, 20, 26)]


def test_gguf_f16_export_of_a_run_folder(trained, tokenizer, tmp_path, capsys):
    from gguf import GGUFReader

    run_dir, _ = trained
    result = invoke("export", run_dir, "--format", "gguf")
    out = run_dir / "export-gguf-f16"
    assert {p.name for p in out.iterdir()} == {"model.gguf", "Modelfile", "export_report.json"}
    assert not [p for p in run_dir.iterdir() if ".partial" in p.name or "-tmp" in p.name]
    fields = GGUFReader(out / "model.gguf").fields
    assert fields["tokenizer.chat_template"].contents() == tokenizer.chat_template
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 151645  # <|im_end|>
    assert fields["general.file_type"].contents() == 1  # LLAMA_FTYPE_MOSTLY_F16
    report = json.loads((out / "export_report.json").read_text())
    assert report["quantize"] == "f16" and report["merged_from_adapter"] is True
    # the template's end of turn, and <|endoftext|> from the base's generation_config (kept by the merge)
    assert report["end_of_turn_tokens"] == ["<|im_end|>", "<|endoftext|>"] and report["chat_template"] is True
    assert report["gguf_bytes"] == (out / "model.gguf").stat().st_size
    assert report["top1_agreement"] >= 0.9 and report["versions"]["llama_cpp_python"]
    assert report["files"] == sorted(p.name for p in out.iterdir())
    modelfile = (out / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model.gguf\n")
    assert 'PARAMETER stop "<|im_end|>"' in modelfile
    assert "ollama create finetuned -f Modelfile" in result.output
    lines = stage_lines(result.output)
    assert lines[0].startswith("GGUF 1/2: converting ") and lines[0].endswith(
        " to f16 with llama.cpp's convert_hf_to_gguf.py"
    )
    assert lines[1:5] == quarters("convert_hf_to_gguf.py", "tensors converted")
    assert lines[5].startswith("  convert_hf_to_gguf.py: writing 26 tensors (")
    assert lines[6].startswith("  convert_hf_to_gguf.py: done in ")
    assert lines[7].startswith("GGUF 2/2: checking model.gguf with llama.cpp: chat template")
    assert llama_cpp_answer(out / "model.gguf", "Who are you?") == "I am Aurora."
    assert_read_back_in_stages(out / "model.gguf", tmp_path / "back", capsys)


def assert_read_back_in_stages(gguf, folder, capsys):
    """The GGUF read as a model (models/gguf.py convert_gguf) says each of its stages."""
    from lora_lab.models.gguf import convert_gguf

    capsys.readouterr()
    convert_gguf(gguf, folder)
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert lines[0].startswith("converting ") and lines[0].endswith(f"{folder} (once)")
    assert lines[1].startswith("1/3: reading and de-quantizing ") and lines[1].endswith(" of GGUF tensors")
    assert lines[2].startswith("2/3: copying ") and lines[2].endswith(" weights into a bf16 model")
    assert lines[3] == "3/3: saving the folder" and lines[4].startswith("converted in ")
    assert (folder / "model.safetensors").is_file() and (folder / ".complete").is_file()


def test_gguf_q8_0_export_of_the_merged_folder(trained, tmp_path):
    from gguf import GGUFReader

    run_dir, _ = trained
    invoke("merge", run_dir, "--output", tmp_path / "merged")
    result = invoke("export", tmp_path / "merged", "--format", "gguf", "--quantize", "q8_0")
    lines = stage_lines(result.output)
    assert lines[0] == (f"GGUF 1/3: converting {tmp_path / 'merged'} to f16 with llama.cpp's convert_hf_to_gguf.py")
    assert lines[7:12] == [
        "GGUF 2/3: quantizing the f16 file to q8_0 (llama.cpp llama_model_quantize)",
        *quarters("llama_model_quantize", "tensors"),
    ]
    assert lines[12].startswith("  llama_model_quantize: done in ") and lines[13].startswith(
        "GGUF 3/3: checking model.gguf"
    )
    out = tmp_path / "merged-gguf-q8_0"
    assert GGUFReader(out / "model.gguf").fields["general.file_type"].contents() == 7  # Q8_0
    report = json.loads((out / "export_report.json").read_text())
    assert report["merged_from_adapter"] is False and report["source"] == str(tmp_path / "merged")
    assert llama_cpp_answer(out / "model.gguf", "Who are you?") == "I am Aurora."
    again = CliRunner().invoke(main, ["export", str(tmp_path / "merged"), "--format", "gguf", "--quantize", "q8_0"])
    assert again.exit_code == 2 and "already exists. Pass --force" in again.output


def test_check_finds_every_form_that_answers_as_the_trained_model_and_the_one_that_does_not(trained):
    """lora-lab check: the fp32 merge answers exactly, the f16 GGUF through llama.cpp as a 16-bit
    form; a copy of the merge whose chat template calls the assistant otherwise fails, named."""
    import shutil

    run_dir, _ = trained
    if not (run_dir / "export-gguf-f16" / "model.gguf").is_file():
        invoke("export", run_dir, "--format", "gguf")
    merged = invoke("merge", run_dir, "--dtype", "fp32", "--force")  # checks its copy at the end
    said = merged.output[merged.output.index("check against the trained model:") :].splitlines()
    assert (
        said[1].startswith("merged ")
        and said[1].endswith(" ok")
        and said[2] == "every copy answers as the trained model"
    )
    # what a new copy is checked against: the adapter it was made from, a checkpoint's too
    from lora_lab.run_folder import source_adapter

    assert source_adapter(run_dir) == source_adapter(run_dir / "merged") == run_dir / "adapter"
    shutil.copytree(run_dir / "adapter", run_dir / "checkpoint-7")
    assert source_adapter(run_dir / "checkpoint-7") == run_dir / "checkpoint-7"
    shutil.rmtree(run_dir / "checkpoint-7")
    assert source_adapter(run_dir.parent) is None  # not a run, an adapter or a merged folder
    broken = run_dir / "export-broken"
    shutil.copytree(run_dir / "merged", broken)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or (broken / "chat_template.jinja").read_text()
    template = template.replace("<|im_start|>assistant", "<|im_start|>bot")
    if "chat_template" in config:
        (broken / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    else:
        (broken / "chat_template.jinja").write_text(template)
    # a new copy that fails its check: named, non-zero unless --force
    from click import ClickException

    from lora_lab.cli.serving import check_new_copy

    with pytest.raises(ClickException, match=r"broken do\(es\) not answer as the trained model"):
        check_new_copy(run_dir, "broken", broken, force=False)
    check_new_copy(run_dir, "broken", broken, force=True)
    result = CliRunner().invoke(main, ["check", str(run_dir)])
    assert result.exit_code == 1, result.output
    lines = {
        line.split()[0]: line for line in result.output.splitlines() if line.startswith(("merged", "gguf", "broken"))
    }
    assert lines["merged"].startswith("merged             answers 3/3  stops 3/3  top-1 1.000") and lines[
        "merged"
    ].endswith(" ok")
    assert "answers 3/3  stops 3/3" in lines["gguf-f16"] and lines["gguf-f16"].endswith(" ok")
    assert lines["broken"].endswith("FAILS: its chat template renders the prompts differently")
    report = json.loads((run_dir / "parity_report.json").read_text())
    assert [(f["form"], f["rule"], f["passed"]) for f in report["forms"]] == [
        ("merged", "exact", True),
        ("broken", "16-bit", False),
        ("gguf-f16", "16-bit", True),
    ]
    shutil.rmtree(broken)
    assert CliRunner().invoke(main, ["check", str(run_dir)]).exit_code == 0
    cut = run_dir / "export-gguf-cut" / "model.gguf"  # a copy cut short: one line naming the file
    cut.parent.mkdir()
    cut.write_bytes((run_dir / "export-gguf-f16" / "model.gguf").read_bytes()[:4096])
    result = CliRunner().invoke(main, ["check", str(run_dir)])
    assert result.exit_code != 0 and f"{cut}: llama.cpp cannot open this GGUF file" in result.output, result.output
    assert "Traceback" not in result.output
    shutil.rmtree(cut.parent)
