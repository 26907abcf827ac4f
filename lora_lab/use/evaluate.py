"""`lora-lab eval`: loss and perplexity on assistant tokens, and generated answers next to references."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..data import read_and_encode
from ..data.encode import IGNORE_INDEX
from ..errors import DataError
from ..run_folder import find_adapter, full_model_of, load_saved_config
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
    output = Path(output) if output else run_dir / "eval_report.json"
    output.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    result["report_path"] = str(output)
    return result


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
