"""`lora-lab eval`: loss and perplexity on assistant tokens, and generated answers next to
references; on preference pairs the reward margin and preference accuracy (DPO's implicit reward
against the run's reference model); on a grpo run's prompts its rewards before and after
(use/reward_eval.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..data import read_and_encode
from ..data.encode import IGNORE_INDEX
from ..errors import CheckpointError, DataError
from ..run_folder import RunFolder, find_adapter, full_model_of, load_saved_config, read_sft_run
from .infer import GenerationSettings, generate_replies, load_adapter_model, load_plain_model


def evaluate_run(
    path: str | Path,
    datasets: list,
    samples_to_generate: int = 5,
    output: str | Path | None = None,
    max_new_tokens: int = 128,
) -> dict:
    """Token-weighted loss over every assistant token of `datasets`, with the run's adapter."""
    run_dir, adapter_dir, model, tokenizer = _load_run(path)
    config = load_saved_config(RunFolder(run_dir).config)
    if adapter_dir is not None and config.train.task == "grpo":  # held-out rewards before and after
        from .reward_eval import evaluate_rewards

        result = evaluate_rewards(
            model, tokenizer, config, list(datasets), reference_of(model, config), samples_to_generate
        )
        result.update(run_dir=str(run_dir), adapter=str(adapter_dir))
        return write_report(result, output, run_dir)
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
    answers = generate_replies(
        model, tokenizer, prompts, GenerationSettings(max_new_tokens=max_new_tokens, do_sample=False)
    )
    eval_loss = total_loss / total_tokens
    result = {
        "run_dir": str(run_dir),
        "adapter": str(adapter_dir) if adapter_dir else None,
        "model": str(full_model_of(path)) if full_model_of(path) else None,
        "data": list(datasets),
        "samples": len(report.samples),
        "assistant_tokens": total_tokens,
        "eval_loss": eval_loss,
        "perplexity": math.exp(eval_loss),
        "not_used": [str(p) for p in loaded.problems + report.problems],
        "generations": [
            {
                "origin": s.origin,
                "prompt": s.messages[-2]["content"],
                "reference": s.messages[-1]["content"],
                "answer": a,
            }
            for s, a in zip(chosen, answers)
        ],
    }
    return write_report(result, output, run_dir)


def _load_run(path) -> tuple:
    """(run folder, adapter folder or None, model, tokenizer) of the run at `path`: its adapter on
    the base, or a full fine-tuning run's own model."""
    if full_model_of(path):  # --tuner full: the run's own model, no adapter
        return (Path(path), None, *load_plain_model(str(full_model_of(path))))
    adapter_dir, found = find_adapter(path)
    if found is None:
        raise CheckpointError(
            f"{path}: an adapter folder outside its run; evaluation reads the run's settings. "
            f"Pass the run folder that holds it."
        )
    return (found, adapter_dir, *load_adapter_model(path))


def write_report(result: dict, output, run_dir: Path) -> dict:
    output = Path(output) if output else RunFolder(run_dir).eval_report
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
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    policy = answer_logps(model, report.samples, pad_id)
    with reference_of(model, config):
        reference = answer_logps(model, report.samples, pad_id)
    beta = config.train.pref_beta
    margins = [beta * ((c - rc) - (r - rr)) for (c, r), (rc, rr) in zip(policy, reference)]
    count = len(margins)
    return {
        "data": datasets,
        "pairs": count,
        "beta": beta,
        "reward_margin": sum(margins) / count,
        "preference_accuracy": sum(m > 0 for m in margins) / count,
        "logp_accuracy": sum(c > r for c, r in policy) / count,
        "reference_logp_accuracy": sum(c > r for c, r in reference) / count,
        "not_used": [str(p) for p in loaded.problems + report.problems],
    }


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


def answer_logps(model, pairs: list, pad_id: int, batch_size: int = 8) -> list:
    """(chosen, rejected) log-probabilities of each pair's answers after its prompt, summed over
    the answer's tokens; the sequences of several pairs run as one right-padded batch."""
    import torch

    sequences = [(p.prompt_ids, answer) for p in pairs for answer in (p.chosen_ids, p.rejected_ids)]
    sums = []
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            chunk = sequences[start : start + batch_size]
            width = max(len(prompt) + len(answer) for prompt, answer in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (prompt, answer) in enumerate(chunk):
                ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
                mask[row, : len(prompt) + len(answer)] = 1
            logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits.float()
            logps = torch.log_softmax(logits, dim=-1)
            for row, (prompt, answer) in enumerate(chunk):
                positions = torch.arange(len(prompt) - 1, len(prompt) + len(answer) - 1)
                target = torch.tensor(answer, device=logps.device)
                sums.append(float(logps[row, positions.to(logps.device), target].sum()))
    return list(zip(sums[0::2], sums[1::2]))


def is_preference_data(specs: list) -> bool:
    """Whether the first dataset's rows are preference pairs (chosen / rejected)."""
    from ..data.pairs import is_pair_row
    from ..data.reading import open_spec

    opened = open_spec(specs[0])
    if opened.entry is not None:
        return bool(opened.entry.entry.get("ranking"))
    for row, _ in opened.head:  # up to the first object
        if isinstance(row, dict):
            return is_pair_row(row)
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
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            total_loss += float(loss)
            total_tokens += int((target != IGNORE_INDEX).sum())
    return total_loss, total_tokens
