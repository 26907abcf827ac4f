"""`lora-lab check RUN`: does every form of the run that exists answer as the trained model does?

The trained model is the base with the run's adapter. The forms are the merged folder (`merged/`),
the 4-bit exports (`export-nf4/`, `export-w4a16/`, `export-awq/`) and the GGUF files
(`export-gguf-*/model.gguf`, through llama.cpp). Each gets the same prompts, rendered by the
form's own chat template (which must give the trained model's ids), and is asked for:
- its greedy answer, against the trained model's;
- whether it stops where the trained model stops (its end-of-turn tokens end generation);
- on the trained model's answer, fed back token by token: how often the form's next-token choice
  is the trained model's (top-1 agreement) and the mean |difference| of the answer tokens'
  log-probabilities.
An exact form (merged in fp32) must give every answer; a 16-bit form must agree at
MIN_16BIT_TOP1 of the answer tokens, a quantized one (the 4-bit exports, GGUF files below 16 bits)
at MIN_QUANTIZED_TOP1; every form must render the template and stop as the trained model does.
With --served URL, a running OpenAI-compatible server is one more form (use/parity_served.py:
its answers, template and stops; an API gives no log-probabilities to compare).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import LoraLabError
from ..log import get_logger, quiet_library_progress
from ..run_folder import RunFolder, find_adapter
from ..run_folder.names import EXPORT_PREFIX, MERGE_REPORT, MODEL_CONFIG
from .gguf_export import GGUF_NAME
from .parity_served import MIN_SERVED_ANSWERS, ServedForm, ServedSide

log = get_logger()

MIN_16BIT_TOP1 = 0.95
MIN_QUANTIZED_TOP1 = 0.80
MAX_EXACT_LOGPROB_DIFF = 1e-3
ANSWER_TOKENS = 32


@dataclass(frozen=True)
class Reference:
    """The trained model's side: each prompt's ids, greedy answer ids, whether it stopped, and
    the log-probabilities of its answer tokens."""

    prompt_ids: list
    answer_ids: list
    stopped: list
    logprobs: list
    stop_ids: list


@dataclass(frozen=True)
class FormCheck:
    form: str
    path: str
    rule: str
    template_ok: bool
    answers_equal: int
    stopped_alike: int
    prompts: int
    top1: float | None  # None: the form gives no next-token scores (a served API)
    mean_logprob_diff: float | None
    passed: bool
    problems: tuple = ()

    def line(self) -> str:
        verdict = "ok" if self.passed else "FAILS: " + "; ".join(self.problems)
        scores = (
            "top-1 n/a    mean |d log p| n/a   "
            if self.top1 is None or self.mean_logprob_diff is None
            else f"top-1 {self.top1:.3f}  mean |d log p| {self.mean_logprob_diff:.4f}"
        )
        return (
            f"{self.form:<18} answers {self.answers_equal}/{self.prompts}  stops {self.stopped_alike}/{self.prompts}  "
            f"{scores}  {verdict}"
        )


def forms_of(run_dir: Path) -> list[tuple[str, Path]]:
    """(name, path) of every form the run folder holds, merged first."""
    folder = RunFolder(run_dir)
    found = [("merged", folder.merged)] if (folder.merged / MODEL_CONFIG).is_file() else []
    for export in folder.exports():
        name = export.name.removeprefix(EXPORT_PREFIX)
        if (export / GGUF_NAME).is_file():
            found.append((name, export / GGUF_NAME))
        elif (export / MODEL_CONFIG).is_file():
            found.append((name, export))
    return found


def check_copy(adapter_dir: Path, name: str, path: Path) -> dict:
    """One new copy (a merge's or an export's output, wherever it was written) against the base
    with the adapter it was made from (inside its run), as `lora-lab check` checks it; its entry
    replaces the same form's in the run's parity_report.json."""
    return check_run(adapter_dir, forms=[(name, path)])


def check_run(
    path: str | Path,
    prompts: list[str] | None = None,
    served: ServedForm | None = None,
    forms: list[tuple[str, Path]] | None = None,
) -> dict:
    """Every form of the run (or the `forms` given) against its trained model, the base with the
    adapter find_adapter takes for `path` (and the server at `served`): the report, also written
    to the run folder's parity_report.json (each form's `passed` says whether it holds)."""
    from .checks import CHECK_PROMPTS
    from .infer import load_adapter_model

    adapter_dir, run_dir = find_adapter(path)
    if run_dir is None:
        raise LoraLabError(f"{path}: an adapter folder outside its run; pass the run folder.")
    kept = _other_forms(run_dir, [name for name, _ in forms]) if forms is not None else []
    forms = forms_of(run_dir) if forms is None else forms
    if not forms and served is None:
        raise LoraLabError(
            f"{run_dir}: no merged folder or export to check; make one with `lora-lab merge` or `lora-lab export`, "
            f"or check a server with --served URL."
        )
    questions = prompts or CHECK_PROMPTS
    with quiet_library_progress():
        model, tokenizer = load_adapter_model(adapter_dir)
    # the server is asked for its models first: one that cannot be reached stops the check early
    side = ServedSide(served, tokenizer, run_dir.name, ANSWER_TOKENS) if served is not None else None
    reference = trained_reference(model, tokenizer, questions)
    del model
    checks = [check_form(name, form, tokenizer, questions, reference, _exact(name, form)) for name, form in forms]
    if side is not None:
        checks.append(check_served(side, questions, reference))
    report = {"run_dir": str(run_dir), "prompts": questions, "forms": kept + [asdict(c) for c in checks]}
    target = RunFolder(run_dir).parity_report
    target.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    report["report_path"] = str(target)
    report["lines"] = [c.line() for c in checks]
    failed: list[str] = [c.form for c in checks if not c.passed]
    report["failed"] = failed
    report["verdict"] = (
        f"{', '.join(failed)} do(es) not answer as the trained model ({target.name} says how)."
        if failed
        else "every copy answers as the trained model"
    )
    return report


def _other_forms(run_dir: Path, names: list[str]) -> list[dict]:
    """The entries of the run's parity_report.json for forms other than `names` (checked on the
    same prompts), which a check of those forms keeps."""
    path = RunFolder(run_dir).parity_report
    if not path.is_file():
        return []
    from .checks import CHECK_PROMPTS

    saved = json.loads(path.read_text())
    if saved.get("prompts") != CHECK_PROMPTS:  # check_copy asks the default prompts
        return []
    return [entry for entry in saved.get("forms", []) if entry.get("form") not in names]


def _exact(name: str, form: Path) -> bool:
    """A merged folder of a run that trained and merged in fp32 must answer exactly."""
    saved = form / MERGE_REPORT
    return name == "merged" and saved.is_file() and json.loads(saved.read_text()).get("dtype") == "fp32"


def trained_reference(model, tokenizer, questions: list[str]) -> Reference:
    from .modelfile import stop_ids

    stops = stop_ids(tokenizer, model)
    prompts = [_prompt_ids(tokenizer, q) for q in questions]
    answers, stopped, logprobs = [], [], []
    for ids in prompts:
        answer = _greedy(model, ids, stops)
        answers.append(answer)
        stopped.append(bool(answer) and answer[-1] in stops)
        logprobs.append(_answer_logprobs(model, ids, answer))
    return Reference(prompts, answers, stopped, logprobs, stops)


def check_form(name: str, form: Path, tokenizer, questions: list, reference: Reference, exact: bool) -> FormCheck:
    """One form against the trained model (module docstring)."""
    gguf = form.suffix == ".gguf"
    quantized = name.split("-")[-1] in ("nf4", "w4a16", "awq") or (gguf and not name.endswith(("f16", "bf16", "f32")))
    rule = "exact" if exact else "quantized" if quantized else "16-bit"
    with quiet_library_progress():
        side = _GgufSide(form, tokenizer) if gguf else _TransformersSide(form)
    template_ok = side.renders(questions, reference.prompt_ids)
    equal = stopped = 0
    agree, diffs = [], []
    for ids, answer, stop, ref_logprobs in zip(
        reference.prompt_ids, reference.answer_ids, reference.stopped, reference.logprobs, strict=True
    ):
        own = side.greedy(ids, reference.stop_ids)
        equal += own == answer
        stopped += (bool(own) and own[-1] in reference.stop_ids) == stop
        top1, logprobs = side.follow(ids, answer)
        agree += top1
        diffs += [abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)]
    side.close()
    top1_share = sum(agree) / len(agree) if agree else 1.0
    mean_diff = sum(diffs) / len(diffs) if diffs else 0.0
    problems = []
    if not template_ok:
        problems.append("its chat template renders the prompts differently")
    if stopped < len(questions):
        problems.append("it does not stop where the trained model stops (end-of-turn tokens)")
    if exact and (equal < len(questions) or mean_diff > MAX_EXACT_LOGPROB_DIFF):
        problems.append(f"an fp32 merge must answer exactly (mean |d log p| <= {MAX_EXACT_LOGPROB_DIFF:g})")
    minimum = MIN_QUANTIZED_TOP1 if quantized else MIN_16BIT_TOP1
    if top1_share < minimum:
        problems.append(f"top-1 agreement {top1_share:.3f} < {minimum} ({rule} rule)")
    return FormCheck(
        name, str(form), rule, template_ok, equal, stopped, len(questions), top1_share, mean_diff, not problems,
        tuple(problems),
    )  # fmt: skip


def check_served(side: ServedSide, questions: list, reference: Reference) -> FormCheck:
    """The served API against the trained model (use/parity_served.py)."""
    template_ok = all(side.ask(q)[0] == side.complete(ids) for q, ids in zip(questions, reference.prompt_ids))
    equal = stopped = 0
    for question, answer, stop in zip(questions, reference.answer_ids, reference.stopped, strict=True):
        text, ended = side.ask(question)
        equal += text == side.answer_text(answer, reference.stop_ids)
        stopped += ended == stop
    problems = []
    if not template_ok:
        problems.append("its chat answers differ from its completions of the trained template's prompts")
    if stopped < len(questions):
        problems.append("it does not end its turn where the trained model does (finish_reason)")
    if equal < MIN_SERVED_ANSWERS * len(questions):
        problems.append(f"{len(questions) - equal} of {len(questions)} greedy answers differ from the trained model's")
    return FormCheck(
        f"served {side.model}", side.url, "served", template_ok, equal, stopped, len(questions), None, None,
        not problems, tuple(problems),
    )  # fmt: skip


def _prompt_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _greedy(model, ids: list[int], stops: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids], device=model.device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
            max_new_tokens=ANSWER_TOKENS,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=stops,
            pad_token_id=stops[0],
        )
    return out[0, len(ids) :].tolist()


def _answer_logprobs(model, ids: list[int], answer: list[int]) -> list[float]:
    return _follow_logits(_logits(model, ids + answer), ids, answer)[1]


def _logits(model, sequence: list[int]):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([sequence], device=model.device)).logits[0].float().cpu()


def _follow_logits(logits, ids: list[int], answer: list[int]) -> tuple[list[bool], list[float]]:
    """At each answer token: whether the logits' top choice is it, and its log-probability."""
    if not answer:
        return [], []
    steps = logits[len(ids) - 1 : len(ids) - 1 + len(answer)].log_softmax(-1)
    top1 = [bool(steps[i].argmax() == token) for i, token in enumerate(answer)]
    return top1, [float(steps[i, token]) for i, token in enumerate(answer)]


class _TransformersSide:
    """A merged or exported folder, loaded as a user would (its own tokenizer and template)."""

    def __init__(self, folder: Path):
        from .infer import load_plain_model
        from .modelfile import stop_ids

        self.model, self.tokenizer = load_plain_model(str(folder))
        self.stop_ids = stop_ids(self.tokenizer, self.model)  # the form's own end-of-turn tokens

    def renders(self, questions: list[str], expected: list) -> bool:
        return [_prompt_ids(self.tokenizer, q) for q in questions] == expected

    def greedy(self, ids: list[int], stops: list[int]) -> list[int]:
        return _greedy(self.model, ids, self.stop_ids or stops)

    def follow(self, ids: list[int], answer: list[int]) -> tuple[list[bool], list[float]]:
        return _follow_logits(_logits(self.model, ids + answer), ids, answer)

    def close(self) -> None:
        from ..device import release_memory

        del self.model
        release_memory()


class _GgufSide:
    """A GGUF file through llama.cpp: its own chat template (from the file's metadata) and its
    own end-of-generation tokens."""

    def __init__(self, gguf: Path, tokenizer):
        from .gguf_export import load_llama

        self.template, self.text_of = tokenizer.chat_template, tokenizer.decode
        self.llm = load_llama(gguf, n_ctx=1024, logits_all=True)

    def renders(self, questions: list[str], expected: list) -> bool:
        """The file's chat template is the trained tokenizer's, and llama.cpp's tokenizer gives
        the trained model's ids for its rendering of each prompt."""
        if self.llm.metadata.get("tokenizer.chat_template") != self.template:
            return False
        return all(
            self.llm.tokenize(self.text_of(ids).encode(), add_bos=False, special=True) == ids for ids in expected
        )

    def greedy(self, ids: list[int], stops: list[int]) -> list[int]:
        import llama_cpp

        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.llm.reset()
        out: list[int] = []
        for token in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if llama_cpp.llama_vocab_is_eog(vocab, token) or len(out) >= ANSWER_TOKENS:
                break
        return out

    def follow(self, ids: list[int], answer: list[int]) -> tuple[list[bool], list[float]]:
        import numpy as np
        import torch

        if not answer:
            return [], []
        self.llm.reset()
        self.llm.eval(ids + answer)
        scores = torch.from_numpy(np.array(self.llm.scores[: len(ids) + len(answer)], dtype=np.float32))
        return _follow_logits(scores, ids, answer)

    def close(self) -> None:
        del self.llm
