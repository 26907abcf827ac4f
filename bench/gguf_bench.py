"""GGUF export of a merged fine-tune, per type: file size, llama.cpp's agreement with the 16-bit
model on the check prompts, and its greedy answers to the identity prompts beside transformers'.

  python bench/gguf_bench.py --merged MERGED_DIR --out DIR [--types f16,q8_0,q4_k_m]
                             [--name Aurora]

Each type is exported by `lora-lab export MERGED_DIR --format gguf --quantize TYPE` into DIR;
the answers are greedy (llama.cpp: create_chat_completion with the GGUF's chat template and eos,
temperature 0; transformers: lora_lab.use.infer.ask), 48 new tokens at most. Prints a markdown
table and writes DIR/gguf-bench.jsonl (a header line with the machine and versions, then one
line per type).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["Who are you?", "What is your name?", "你是谁？"]
MAX_NEW_TOKENS = 48


def llama_cpp_answers(gguf: Path) -> list[str]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=512, verbose=False, seed=0)
    return [
        llm.create_chat_completion([{"role": "user", "content": p}], temperature=0.0, max_tokens=MAX_NEW_TOKENS)[
            "choices"
        ][0]["message"]["content"]
        for p in PROMPTS
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--merged", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--types", default="f16,q8_0,q4_k_m")
    parser.add_argument("--name", default="Aurora")
    args = parser.parse_args()
    from lora_lab.use.export import library_versions, weights_bytes
    from lora_lab.use.gguf_export import export_gguf, gguf_versions
    from lora_lab.use.infer import ask, load_plain_model

    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_plain_model(str(args.merged))
    reference = [ask(model, tokenizer, p, MAX_NEW_TOKENS) for p in PROMPTS]
    del model
    header = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "command": " ".join(sys.argv),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "merged": str(args.merged),
        "safetensors_bytes": weights_bytes(args.merged),
        "transformers_answers": reference,
        "versions": {**library_versions(), **gguf_versions()},
    }
    lines = [header]
    rows = [
        "| type | GGUF size | same next token (check prompts) | max abs logit diff | "
        "answers equal transformers' | answers with the name | export s |",
        "|---|---|---|---|---|---|---|",
    ]
    for quantize in args.types.split(","):
        started = time.time()
        result = export_gguf(args.merged, quantize=quantize, output=args.out / quantize, force=True)
        answers = llama_cpp_answers(result.gguf_file)
        equal = sum(a == r for a, r in zip(answers, reference))
        named = sum(args.name in a for a in answers)
        lines.append(
            {
                "quantize": quantize,
                "gguf_bytes": result.gguf_bytes,
                "top1_agreement": result.top1_agreement,
                "max_abs_logit_diff": result.max_abs_logit_diff,
                "answers": answers,
                "answers_equal": equal,
                "answers_named": named,
                "seconds": round(time.time() - started, 1),
            }
        )
        rows.append(
            f"| {quantize} | {result.gguf_bytes / 2**20:.0f} MiB | "
            f"{result.top1_agreement:.1%} | {result.max_abs_logit_diff:.2f} | "
            f"{equal}/{len(PROMPTS)} | {named}/{len(PROMPTS)} | "
            f"{lines[-1]['seconds']:.0f} |"
        )
    (args.out / "gguf-bench.jsonl").write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    print("\n".join(rows))
    for line in lines[1:]:
        print(line["quantize"], json.dumps(line["answers"], ensure_ascii=False))
    print("transformers", json.dumps(reference, ensure_ascii=False))


if __name__ == "__main__":
    main()
