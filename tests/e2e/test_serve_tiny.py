"""merge, infer, eval and chat on a tiny model trained by `lora-lab run`."""

import json
import os

import pytest
from click.testing import CliRunner

from lora_lab.cli import main
from tests.support.tiny import train_tiny_run, write_jsonl

ROWS = [{"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Aurora."}]}]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    return train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("serve"), ROWS)


def test_merge_matches_adapter_and_reloads(trained, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from lora_lab.use.infer import ask, load_adapter_model

    run_dir, _ = trained
    result = invoke("merge", run_dir, "--dtype", "fp32", "--output", tmp_path / "m")
    assert result.exit_code == 0, result.output
    merged_dir = tmp_path / "m"
    report = json.loads((merged_dir / "merge_report.json").read_text())
    assert report["max_abs_logit_diff"] < 1e-4 and report["dtype"] == "fp32"
    assert report["top1_agreement"] == 1.0
    assert report["checks"]["lora_layers_left"] == 0
    files = {p.name for p in merged_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "merge_report.json",
    } <= files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))]
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert (merged_dir / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    generation = json.loads((merged_dir / "generation_config.json").read_text())
    assert 151645 in generation["eos_token_id"]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not [n for n, _ in merged.named_modules() if "lora" in n]
    adapter_model, tokenizer = load_adapter_model(run_dir, dtype="fp32")
    ids = torch.tensor([[151644, 872, 198, 15191, 525, 498, 30, 151645]])
    with torch.no_grad():
        assert torch.allclose(adapter_model(ids).logits, merged(ids).logits, atol=1e-4)
    assert ask(merged, tokenizer, "Who are you?", 10) == "I am Aurora."
    assert "vllm serve" in result.output and "--max-lora-rank 16" in result.output


def test_merge_refuses_to_overwrite(trained, tmp_path):
    run_dir, _ = trained
    (tmp_path / "m").mkdir()
    result = CliRunner().invoke(main, ["merge", str(run_dir), "--output", str(tmp_path / "m")])
    assert result.exit_code == 2 and "already exists. Pass --force" in result.output
    result = invoke("merge", run_dir, "--output", tmp_path / "m", "--force", "--dtype", "fp32")
    assert result.exit_code == 0 and (tmp_path / "m" / "merge_report.json").is_file()


def test_a_cpu_run_merges_by_default_in_its_fp32_training_precision(trained, tmp_path):
    """A CPU run trains in fp32 (--dtype auto), config.yaml records it, and `merge` without
    --dtype merges in fp32 and checks against the fp32 bound (not the 16-bit rule)."""
    import yaml
    from safetensors import safe_open

    run_dir, _ = trained
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["dtype"] == "fp32"
    assert saved["resolved_from"]["model.dtype"] == "auto (CPU)"
    result = invoke("merge", run_dir, "--output", tmp_path / "m")
    assert result.exit_code == 0, result.output
    assert "(fp32: the run's training precision)" in result.output
    assert "check (fp32 rule: max |logit difference| <= 0.001): passed" in result.output
    with safe_open(tmp_path / "m" / "model.safetensors", "pt") as weights:
        assert {str(weights.get_tensor(k).dtype) for k in list(weights.keys())} == {"torch.float32"}
    report = json.loads((tmp_path / "m" / "merge_report.json").read_text())
    assert report["dtype"] == "fp32" and report["max_abs_logit_diff"] <= 1e-3
    assert report["checks"]["rule"] == "fp32 rule: max |logit difference| <= 0.001"
    # --dtype still chooses; the check then says it applied the 16-bit rule
    result = invoke("merge", run_dir, "--output", tmp_path / "b", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert "(bf16: --dtype)" in result.output
    assert "check (bf16 rule: same next token at >= 95% of confident positions" in result.output


def test_vllm_rank_is_the_smallest_accepted(tmp_path):
    from lora_lab.planning.serving import vllm_commands
    from lora_lab.use.merge import MergeResult

    def commands(rank, modules=("q_proj", "v_proj")):
        return vllm_commands(
            MergeResult(
                tmp_path, "Qwen/Qwen2.5-7B-Instruct", tmp_path / "a", "bf16", 0.0, 1.0, rank, list(modules), "none"
            )
        )

    assert "--max-lora-rank 8" in commands(4)["commands"]["adapter"]
    assert "--max-lora-rank 32" in commands(24)["commands"]["adapter"]
    assert "adapter" not in commands(1024)["commands"]
    warned = commands(8, ("q_proj", "embed_tokens"))["warnings"]
    assert warned and "embed_tokens" in warned[0]


def test_infer_answers_every_row_in_order(trained, tmp_path):
    from lora_lab.use.infer import ask, load_adapter_model

    run_dir, _ = trained
    questions = ["What is 2+2?", "Who are you?", "Name a colour.", "Who are you?", "Hi"]
    rows = [{"query": q} for q in questions]
    rows[0]["response"] = "It is 4."
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "a.jsonl"
    result = invoke(
        "infer",
        "--run",
        run_dir,
        "--input",
        prompts,
        "--output",
        out,
        "--greedy",
        "--batch-size",
        2,
        "--max-new-tokens",
        8,
    )
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in out.open()]
    assert [a["origin"] for a in answers] == [f"{prompts}:{i}" for i in range(1, 6)]
    assert answers[0]["reference"] == "It is 4." and "reference" not in answers[1]
    assert answers[1]["answer"] == answers[3]["answer"] == "I am Aurora."
    # Left-padded batches answer exactly as one prompt at a time would.
    model, tokenizer = load_adapter_model(run_dir)
    assert [a["answer"] for a in answers] == [ask(model, tokenizer, q, 8) for q in questions]


def test_infer_needs_exactly_one_source(trained, tmp_path):
    run_dir, data = trained
    result = CliRunner().invoke(main, ["infer", "--input", str(data), "--output", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and "exactly one of --run" in result.output


def test_eval_reports_loss_perplexity_and_samples(trained, tmp_path):
    run_dir, data = trained
    result = invoke("eval", run_dir, "--data", data, "--samples", 2, "--output", tmp_path / "e.json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "e.json").read_text())
    # Untrained, the loss is about ln(151936) = 11.9.
    assert report["samples"] == 1 and report["eval_loss"] < 6
    assert report["perplexity"] == pytest.approx(2.718281828 ** report["eval_loss"])
    assert [g["answer"] for g in report["generations"]] == ["I am Aurora."]
    assert report["generations"][0]["reference"] == "I am Aurora."
    assert "perplexity" in result.output


def test_chat_loop_commands_and_compare(trained):
    from lora_lab.use.infer import GenerationSettings, chat_loop, load_adapter_model

    run_dir, _ = trained
    model, tokenizer = load_adapter_model(run_dir)
    lines = iter(["Who are you?", "/system Be terse.", "/system", "/reset", "Who are you?", "/quit"])
    out = []
    chat_loop(
        model,
        tokenizer,
        GenerationSettings(max_new_tokens=10, do_sample=False),
        lambda prompt: next(lines),
        out.append,
        compare=True,
    )
    text = "".join(out)
    assert text.count("[fine-tuned] I am Aurora.") == 2
    assert "(system prompt set; conversation cleared)" in text
    assert "(system prompt cleared; conversation cleared)" in text
    assert "(conversation cleared)" in text
    base_answers = [part.split("\n")[0] for part in text.split("[base] ")[1:]]
    assert all(answer != "I am Aurora." for answer in base_answers)


WHO_TASK = """\
task: who_are_you
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<|im_end|>"]
  do_sample: false
  max_gen_toks: 12
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_punctuation: false
"""


def test_eval_tasks_scores_the_base_and_the_fine_tune_with_lm_eval(trained, tiny_model_dir, tmp_path):
    """A local lm-eval task (the answer the run trained, matched exactly in a greedy answer that
    stops at the end of the turn): the base never gives it, the fine-tune always does, and the
    report holds both with their change."""
    pytest.importorskip("lm_eval", reason="--tasks needs lora-lab[eval] (lm-eval)")
    run_dir, _ = trained
    rows = [{"question": "Who are you?", "answer": "I am Aurora."}] * 3
    data = write_jsonl(tmp_path / "who.jsonl", rows)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "who.yaml").write_text(WHO_TASK.format(data=data))
    result = invoke("eval", run_dir, "--tasks", "who_are_you", "--include-path", tmp_path / "tasks")
    assert result.exit_code == 0, result.output
    report = json.loads((run_dir / "benchmark_report.json").read_text())
    [score] = report["scores"]
    assert (score["task"], score["metric"]) == ("who_are_you", "exact_match")
    assert (score["base"], score["tuned"], score["change"]) == (0.0, 1.0, 1.0)
    assert report["settings"]["chat_template"] is True and report["lm_eval"].startswith("0.4.")
    table = result.output[result.output.index("task ") :].splitlines()
    assert table[1].split() == ["who_are_you", "exact_match", "0.000", "±0.000", "1.000", "±0.000", "+1.000"]

    # the web page's Benchmarks tab: the stored report, a new scoring of one example, and a task
    # folder outside the page's allowed folders refused
    from lora_lab.ui.form import AllowedFolders
    from lora_lab.ui.page import Page

    page = Page(AllowedFolders([run_dir.parent, tiny_model_dir, tmp_path]), None)
    stored = page.benchmarks(str(run_dir), "", "", None).splitlines()
    assert stored[1].split() == table[1].split() and stored[-1] == f"report: {run_dir / 'benchmark_report.json'}"
    again = page.benchmarks(str(run_dir), "who_are_you", str(tmp_path / "tasks"), 1).splitlines()
    assert again[1].split()[-1] == "+1.000", again
    assert json.loads((run_dir / "benchmark_report.json").read_text())["settings"]["limit"] == 1
    outside = page.benchmarks(str(run_dir), "who_are_you", "/etc", None)
    assert outside.startswith("error: task folder: /etc is outside the folders this page may use"), outside


def test_eval_tasks_refuses_an_unknown_task_in_one_line(trained):
    pytest.importorskip("lm_eval", reason="--tasks needs lora-lab[eval] (lm-eval)")
    run_dir, _ = trained
    empty = CliRunner().invoke(main, ["eval", str(run_dir), "--tasks", " , "])
    assert empty.exit_code == 2 and "--tasks ' , ': name at least one lm-eval task" in empty.output
    result = CliRunner().invoke(main, ["eval", str(run_dir), "--tasks", "hellaswagg"])
    assert result.exit_code == 2
    assert result.output.startswith("error: --tasks hellaswagg: not a task lm-eval knows. Close names: hellaswag")
    assert "Traceback" not in result.output


# a 40-step run of its own (over a minute of 2 CPU cores): opt-in (make test-slow); make test keeps
# `lora-lab eval --tasks` on the shared run and its refusal of an unknown task (above)
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LORA_LAB_SLOW"), reason="a run of its own; LORA_LAB_SLOW=1 runs it")
def test_eval_tasks_at_the_end_of_training_scores_base_and_fine_tune(tiny_model_dir, tmp_path):
    """`lora-lab run --eval-tasks`: the run trains, then lm-eval scores the base and the fine-tune
    on the local task: the table is printed and benchmark_report.json written in the run folder;
    an unknown task is refused before anything trains."""
    pytest.importorskip("lm_eval", reason="--eval-tasks needs lora-lab[eval] (lm-eval)")
    data = write_jsonl(tmp_path / "who.jsonl", [{"question": "Who are you?", "answer": "I am Aurora."}] * 3)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "who.yaml").write_text(WHO_TASK.format(data=data))
    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    common = ["run", "--model", tiny_model_dir, "--data", f"{rows}#8", "--max-steps", 40, "--lr", "1e-2",
              "--lora-rank", 16, "--lora-dropout", 0, "--output-dir", tmp_path, "--set",
              f"train.eval_tasks_path={tmp_path / 'tasks'}"]  # fmt: skip
    wrong = CliRunner().invoke(main, [str(a) for a in common + ["--eval-tasks", "who_are_yuo", "--run-name", "w"]])
    assert wrong.exit_code != 0 and "--eval-tasks who_are_yuo: not a task lm-eval knows. Close names: who_are_you" in (
        wrong.output
    )
    assert not (tmp_path / "w").exists()  # refused before the run folder was made
    result = invoke(*common, "--eval-tasks", "who_are_you", "--run-name", "r")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r" / "benchmark_report.json").read_text())
    [score] = report["scores"]
    assert (score["task"], score["base"], score["tuned"], score["change"]) == ("who_are_you", 0.0, 1.0, 1.0)
    table = result.output[result.output.index("task ") :].splitlines()
    assert table[1].split() == ["who_are_you", "exact_match", "0.000", "±0.000", "1.000", "±0.000", "+1.000"]
