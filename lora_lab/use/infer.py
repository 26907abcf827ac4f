"""Generation with a base model, a trained adapter or a merged folder: batch answers and chat."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ModelArgs
from ..data.reading import normalise_rows, open_spec, parse_items
from ..errors import DataError, LoraLabError
from ..log import get_logger
from ..models.load import LoadOptions, choose_precision, load_base_model, load_tokenizer
from ..run_folder import base_model_of, find_adapter, full_model_of

log = get_logger()


@dataclass
class GenerationSettings:
    """Unset fields (None) keep the model's own generation_config values."""

    max_new_tokens: int = 256
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    def as_kwargs(self) -> dict:
        kwargs: dict[str, Any] = {"max_new_tokens": self.max_new_tokens}
        for name in ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.do_sample is False:  # greedy: sampling knobs of generation_config do not apply
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs


def adapter_tokenizer_source(adapter_dir: Path, base_args: ModelArgs) -> str:
    """Where an adapter's tokenizer and chat template are: saved with it by training, else the base's."""
    return str(adapter_dir) if (adapter_dir / "tokenizer_config.json").is_file() else base_args.name


def load_adapter_model(path: str | Path, dtype: str = "auto"):
    """Base model + adapter from a run or adapter folder, ready to generate."""
    from peft import PeftModel

    adapter_dir, run_dir = find_adapter(path)
    # generate on the 16-bit base, whatever trained it
    base_args = dataclasses.replace(base_model_of(adapter_dir, run_dir), quantization="none")
    base = load_base_model(base_args, choose_precision(dtype), LoadOptions(for_training=False))
    tokenizer = load_tokenizer(adapter_tokenizer_source(adapter_dir, base_args))
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    model.eval()
    return model, tokenizer


def load_plain_model(spec: str, dtype: str = "auto"):
    """A base or merged model by --model spec, ready to generate."""
    model = load_base_model(ModelArgs(name=spec), choose_precision(dtype), LoadOptions(for_training=False))
    model.eval()
    return model, load_tokenizer(spec)


def generate_replies(
    model,
    tokenizer,
    conversations: list,
    settings: GenerationSettings | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> list[str]:
    """One reply per conversation (a list of messages ending with the user's), in input order.
    progress: a line after each batch (prompts answered, new tokens per second)."""
    import time

    import torch

    settings = settings or GenerationSettings()
    tokenizer.padding_side = "left"
    replies, new_tokens, started = [], 0, time.monotonic()
    for start in range(0, len(conversations), batch_size):
        chunk = conversations[start : start + batch_size]
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chunk]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        batch = {k: v.to(model.device) for k, v in batch.items()}
        with torch.no_grad():
            output = model.generate(**batch, **settings.as_kwargs(), pad_token_id=tokenizer.pad_token_id)
        generated = output[:, batch["input_ids"].shape[1] :]
        for row in generated:
            replies.append(tokenizer.decode(row, skip_special_tokens=True).strip())
        new_tokens += int((generated != tokenizer.pad_token_id).sum())
        if progress:
            seconds = max(time.monotonic() - started, 1e-9)
            log.info(
                f"generated {len(replies)}/{len(conversations)} prompts · {new_tokens} new "
                f"tokens · {new_tokens / seconds:,.1f} tok/s"
            )
    return replies


def ask(model, tokenizer, question: str, max_new_tokens: int = 64) -> str:
    """Greedy answer to one question (used by the demo and the tests)."""
    return generate_replies(
        model,
        tokenizer,
        [[{"role": "user", "content": question}]],
        GenerationSettings(max_new_tokens=max_new_tokens, do_sample=False),
    )[0]


def load_generation_model(
    run: str | None = None, adapter: str | None = None, model: str | None = None, dtype: str = "auto"
):
    """Exactly one of a run folder, an adapter folder or a model (base or merged)."""
    given = [v for v in (run, adapter, model) if v]
    if len(given) != 1:
        raise LoraLabError("pass exactly one of --run RUN_DIR, --adapter DIR or --model MODEL.")
    if model:
        return load_plain_model(model, dtype)
    if run and full_model_of(run):
        return load_plain_model(str(full_model_of(run)), dtype)
    folder = run or adapter
    assert folder is not None  # exactly one was given
    return load_adapter_model(folder, dtype)


def read_prompts(path: str, row_format: str = "auto") -> list:
    """Prompts from any dataset format: (origin, prompt messages, reference reply or None)."""
    opened = open_spec(path)
    fmt, _ = opened.sft_format(row_format)
    rows = normalise_rows(parse_items(opened.path, opened.items), fmt, opened.entry, require_reply=False)
    if rows.problems:
        shown = "\n  ".join(str(p) for p in rows.problems[:10])
        raise DataError(
            f"--input {path}: {len(rows.problems)} rows are not usable prompts (nothing was generated):\n  {shown}"
        )
    prompts = []
    for sample in rows.samples:
        messages, reference = sample.messages, None
        if messages[-1]["role"] == "assistant":
            messages, reference = messages[:-1], messages[-1]["content"]
        prompts.append((sample.origin, messages, reference))
    return prompts


def run_inference(
    model, tokenizer, input_path: str, output_path: str, settings: GenerationSettings, batch_size: int = 8
) -> int:
    """Answer every row of input_path; write one JSON line per row, in input order."""
    import json

    prompts = read_prompts(input_path)
    batches = -(-len(prompts) // batch_size)
    log.info(
        f"generating answers to {len(prompts)} prompts of {input_path} in {batches} "
        f"batches of up to {batch_size} (at most {settings.max_new_tokens} new tokens each)"
    )
    replies = generate_replies(model, tokenizer, [p[1] for p in prompts], settings, batch_size, progress=True)
    with open(output_path, "w", encoding="utf-8") as handle:
        for (origin, messages, reference), reply in zip(prompts, replies):
            row = {"origin": origin, "messages": messages, "answer": reply}
            if reference is not None:
                row["reference"] = reference
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(replies)


def stream_reply(model, tokenizer, messages: list, settings: GenerationSettings, write) -> str:
    """Generate one reply, writing text pieces as they come; returns the whole reply."""
    import threading

    import torch
    from transformers import TextIteratorStreamer

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    batch = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = {**batch, **settings.as_kwargs(), "streamer": streamer, "pad_token_id": tokenizer.pad_token_id}
    worker = threading.Thread(target=lambda: torch.no_grad()(model.generate)(**kwargs))
    worker.start()
    pieces = []
    for piece in streamer:
        pieces.append(piece)
        write(piece)
    worker.join()
    return "".join(pieces).strip()


CHAT_HELP = "commands: /reset (new conversation), /system TEXT, /quit"


def chat_loop(model, tokenizer, settings: GenerationSettings, read, write, compare: bool = False) -> None:
    """Interactive multi-turn chat. `read(prompt)` returns a line or None at end of input."""
    import contextlib

    system: str | None = None
    history: list[dict[str, str]] = []
    write(f"{CHAT_HELP}\n")
    while True:
        line = read(">>> ")
        if line is None or line.strip() == "/quit":
            return
        line = line.strip()
        if not line:
            continue
        if line == "/reset":
            history = []
            write("(conversation cleared)\n")
            continue
        if line.startswith("/system"):
            system, history = line[len("/system") :].strip() or None, []
            write(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)\n")
            continue
        if line.startswith("/") and not line.startswith("//"):
            write(
                f"(unknown command {line.split()[0]}; {CHAT_HELP}; start a message with // to "
                f"send one that begins with /)\n"
            )
            continue
        if line.startswith("//"):
            line = line[1:]
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        if compare:
            write("[base] ")
            with model.disable_adapter() if hasattr(model, "disable_adapter") else (contextlib.nullcontext()):
                stream_reply(model, tokenizer, messages, settings, write)
            write("\n[fine-tuned] ")
        reply = stream_reply(model, tokenizer, messages, settings, write)
        write("\n")
        history.append({"role": "assistant", "content": reply})
