"""`lora-lab eval`: loss and perplexity on assistant tokens, and generated answers next to
references; on preference pairs the reward margin and preference accuracy (DPO's implicit reward
against the run's reference model)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..data import read_and_encode
from ..data.encode import IGNORE_INDEX
from ..errors import DataError
from ..run_folder import find_adapter, full_model_of, load_saved_config, read_sft_run
from .infer import GenerationSettings, generate_replies, load_adapter_model, load_plain_model


def evaluate_run(path: str | Path, datasets: list, samples_to_generate: int = 5,
                 output: str | Path | None = None, max_new_tokens: int = 128) -> dict:
    """Token-weighted loss over every assistant token of `datasets`, with the run's adapter."""
    if full_model_of(path):  # --tuner full: the run's own model, no adapter
        run_dir, adapter_dir = Path(path), None
        model, tokenizer = load_plain_model(str(full_model_of(path)))
    else:
        adapter_dir, run_dir = find_adapter(path)
        model, tokenizer = load_adapter_model(path)
    config = load_saved_config(run_dir / "config.yaml")
    if adapter_dir is not None and is_preference_data(list(datasets)):
        result = evaluate_preferences(model, tokenizer, config, list(datasets))
        result.update(run_dir=str(run_dir), adapter=str(adapter_dir))
        return write_report(result, output, run_dir)
    loaded, report = read_and_encode(list(datasets), config.data, tokenizer, config.train.seed)
    if not report.samples:
        raise DataError(f"--data {' '.join(datasets)}: no usable sample to evaluate.")
    total_loss, total_tokens = assistant_token_loss(model, report.samples)
    chosen = loaded.samples[:samples_to_generate]
    prompts = [s.messages[:-1] for s in chosen]
    answers = generate_replies(model, tokenizer, prompts,
                               GenerationSettings(max_new_tokens=max_new_tokens, do_sample=False))
    eval_loss = total_loss / total_tokens
    result = {
        "run_dir": str(run_dir), "adapter": str(adapter_dir) if adapter_dir else None,
        "model": str(full_model_of(path)) if full_model_of(path) else None, "data": list(datasets),
        "samples": len(report.samples), "assistant_tokens": total_tokens,
        "eval_loss": eval_loss, "perplexity": math.exp(eval_loss),
        "not_used": [str(p) for p in loaded.problems + report.problems],
        "generations": [{"origin": s.origin, "prompt": s.messages[-2]["content"],
                         "reference": s.messages[-1]["content"], "answer": a}
                        for s, a in zip(chosen, answers)],
    }
    return write_report(result, output, run_dir)


def write_report(result: dict, output, run_dir: Path) -> dict:
    output = Path(output) if output else run_dir / "eval_report.json"
    output.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    result["report_path"] = str(output)
    return result


def evaluate_preferences(model, tokenizer, config, datasets: list) -> dict:
    """Reward margin and preference accuracy on pairs. A pair's reward margin is
    beta * ((log p(chosen) - log p_ref(chosen)) - (log p(rejected) - log p_ref(rejected))),
    log-probabilities summed over the answer's tokens; the reference is the run's own (the base
    model, or the --from-run SFT adapter). Accuracy: the share of pairs with a positive margin.
    logp_accuracy: the share where the model itself gives the chosen answer the higher
    log-probability, for the policy and for the reference."""
    task = config.train.task if config.train.task in ("dpo", "orpo", "simpo") else "dpo"
    loaded, report = read_and_encode(datasets, config.data, tokenizer, config.train.seed, task)
    if not report.samples:
        raise DataError(f"--data {' '.join(datasets)}: no usable preference pair to evaluate.")
    policy = [answer_logps(model, pair) for pair in report.samples]
    with reference_of(model, config):
        reference = [answer_logps(model, pair) for pair in report.samples]
    beta = config.train.pref_beta
    margins = [beta * ((c - rc) - (r - rr)) for (c, r), (rc, rr) in zip(policy, reference)]
    count = len(margins)
    return {"data": datasets, "pairs": count, "beta": beta,
            "reward_margin": sum(margins) / count,
            "preference_accuracy": sum(m > 0 for m in margins) / count,
            "logp_accuracy": sum(c > r for c, r in policy) / count,
            "reference_logp_accuracy": sum(c > r for c, r in reference) / count,
            "not_used": [str(p) for p in loaded.problems + report.problems]}


def reference_of(model, config):
    """The context in which `model` (the run's PEFT model) computes as its reference."""
    if not config.train.from_run:
        return model.disable_adapter()
    import contextlib

    adapter_dir, _ = read_sft_run(config.train.from_run)
    if "reference" not in model.peft_config:
        model.load_adapter(str(adapter_dir), adapter_name="reference")

    @contextlib.contextmanager
    def use_reference():
        active = model.active_adapter
        model.set_adapter("reference")
        try:
            yield
        finally:
            model.set_adapter(active)
    return use_reference()


def answer_logps(model, pair) -> tuple[float, float]:
    """Summed log-probabilities of the chosen and the rejected answer after the prompt."""
    import torch

    out = []
    with torch.no_grad():
        for answer in (pair.chosen_ids, pair.rejected_ids):
            ids = torch.tensor([pair.prompt_ids + answer], device=model.device)
            # the output head only where an answer token is predicted
            logits = model(input_ids=ids, logits_to_keep=len(answer) + 1).logits[0, :-1].float()
            logps = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(answer, device=model.device)
            out.append(float(logps.gather(1, target[:, None]).sum()))
    return out[0], out[1]


def is_preference_data(specs: list) -> bool:
    """Whether the first dataset's rows are preference pairs (chosen / rejected)."""
    from ..data.dataset_info import DatasetInfoEntry
    from ..data.formats import parse_spec, read_rows

    source, _ = parse_spec(specs[0])
    entry = DatasetInfoEntry.from_source(source)
    if entry is not None:
        return bool(entry.entry.get("ranking"))
    for row, _ in read_rows(source, []):
        if isinstance(row, dict):
            return "rejected_response" in row or ("chosen" in row and "rejected" in row)
    return False


def assistant_token_loss(model, samples: list) -> tuple[float, int]:
    """Summed cross-entropy over the trained (assistant) tokens of encoded samples, and how many
    tokens that is. Any causal LM: base+adapter, merged, or a quantized export."""
    import torch

    total_loss, total_tokens = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample.input_ids], device=model.device)
            labels = torch.tensor([sample.labels], device=model.device)
            logits = model(input_ids=ids).logits[:, :-1].float()
            target = labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                ignore_index=IGNORE_INDEX, reduction="sum")
            total_loss += float(loss)
            total_tokens += int((target != IGNORE_INDEX).sum())
    return total_loss, total_tokens
