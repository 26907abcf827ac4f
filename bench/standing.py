"""Where lora-lab stands today: the tables of docs/benchmarks.md (one per comparison), generated
from bench/results by bench/report.py. The call-by-call tables are bench/report.py's history page.

Each row is the newest stored measurement of its cell: for a comparison, the newest pairs of the
two sides measured in one device call (up to two, shown as their spread), the GPU and date, and
a numbered source giving the results file and the exact command its header recorded. A row
measured before TRAINING_PATH_SINCE ran an earlier training path and says so.
"""

from __future__ import annotations

import re
from pathlib import Path

import report
from run import TIERS

TRAINING_PATH_SINCE = "2026-12-05 02:46 UTC"
"""The newest change to what a lora-lab GPU step computes and holds (the backward pass through
down and SwiGLU 2048 tokens at a time: models/fast_lora/mlp.py), first run in that call. A
lora-lab figure measured before it ran earlier code."""
CUDA_EVENT_TIMER_SINCE = "2026-12-02 21:45 UTC"
"""Since then steps are timed with CUDA events at every step's end, on both sides (StepTimer);
before, with a device sync per step."""
TODAYS_VARIANTS = ("back2048",)
"""Peer cells whose one changed setting is today's default (model.fast_lora_down_backward_tokens 2048), so
they stand for the cell as shipped."""
PEER_ROWS = (
    ("7b-4096", "7B bf16, 4 samples x 4096 tokens a step"),
    ("7b-1024", "7B bf16, 4 samples x 1024 tokens a step"),
    ("7b-2048-nf4", "7B QLoRA nf4 (16gb preset), 4 x 2048"),
    ("1.5b-4096", "1.5B bf16, 4 x 4096"),
    ("0.5b-4096", "0.5B bf16, 4 x 4096"),
    ("qwen3.5-4b-4096", "Qwen3.5-4B bf16 (24gb preset), 4 x 4096"),
    ("sft-7b", "7B, one epoch of the real-length SFT mix"),
)
LONG_ROWS = (  # (tier, 4-bit?, Unsloth's length in the long-context plan)
    ("16gb", True, 49152),
    ("24gb", False, 32768),
)
LONG_CONTEXT_COMMAND = 'bash bench/device_call.sh "" plan:long-context:1'


class Sources:
    """Numbered sources of one table: GPU, date, the results file and its stored command."""

    def __init__(self) -> None:
        self.headers: list[dict] = []
        self.marked: set[int] = set()

    def cite(self, header: dict, lora_lab: bool = False) -> str:
        """`header`'s number; lora_lab: the cited rows are lora-lab's, so the source says
        "earlier code" where it ran before TRAINING_PATH_SINCE."""
        key = (header.get("_path"), header.get("date"), header.get("command"))
        keys = [(h.get("_path"), h.get("date"), h.get("command")) for h in self.headers]
        if key not in keys:
            self.headers.append(header)
            keys.append(key)
        number = keys.index(key) + 1
        if lora_lab and earlier(header):
            self.marked.add(number)
        return f"[{number}]"

    def render(self) -> str:
        return "\n".join(
            f"[{n}] {gpu_of(h)}, {h['date']}{' (earlier code)' if n in self.marked else ''}: `{h['command']}` "
            f"({h['_path']})"
            for n, h in enumerate(self.headers, 1)
        )


def gpu_of(header: dict) -> str:
    return (header.get("gpu") or header.get("machine") or "?").replace("NVIDIA ", "")


def earlier(header: dict) -> bool:
    return header["date"] < TRAINING_PATH_SINCE


def spread(values: list, fmt: str = "{:,.0f}") -> str:
    """One figure, or the lowest and highest of several ("12,588-12,617")."""
    low, high = min(values), max(values)
    return fmt.format(low) if fmt.format(low) == fmt.format(high) else f"{fmt.format(low)}-{fmt.format(high)}"


def peer_files() -> list[tuple[dict, dict]]:
    """(first header, cells by label) of every peer results file, oldest first."""
    from peer_report import rows_of

    files = []
    for path in report.RESULTS.glob("*-peer-call*.jsonl"):
        headers, cells = rows_of(path)
        files.append(({**headers[0], "_path": f"bench/results/{path.name}"}, cells))
    return sorted(files, key=lambda f: f[0]["date"])


def peer_pairs(name: str) -> list[tuple[dict, dict, dict]]:
    """The newest two (header, lora-lab row, Unsloth row) pairs of peer cell `name` as shipped,
    each pair from one call, both sides without error, from the newest call that has one and the
    calls of its sitting (same_session); newest first."""
    found = []
    for header, cells in reversed(peer_files()):
        if found and not same_session(found[0][0], header):
            break
        for run in ("2", "1"):
            theirs = cells.get(f"us-{name}-{run}")
            ours = next(
                (
                    cells[label]
                    for label in [f"ll-{name}-{v}-{run}" for v in TODAYS_VARIANTS] + [f"ll-{name}-{run}"]
                    if label in cells
                ),
                None,
            )
            if ours and theirs and not ours.get("error") and not theirs.get("error"):
                found.append((header, ours, theirs))
    return found[:2]


def same_session(newest: dict, other: dict) -> bool:
    """Two calls of one sitting on one code: within an hour, on one side of TRAINING_PATH_SINCE."""
    from datetime import datetime

    def at(header: dict) -> datetime:
        return datetime.strptime(header["date"], "%Y-%m-%d %H:%M UTC")

    return (at(newest) - at(other)).total_seconds() <= 3600 and earlier(newest) == earlier(other)


def _timing(header: dict, row: dict) -> str:
    if row.get("train_seconds"):
        return "wall time of one epoch"
    timer = "CUDA events" if header["date"] >= CUDA_EVENT_TIMER_SINCE else "a sync per step"
    steps = row["steps"]
    return f"{steps} steps, median of the last {steps - 2}, {timer}"


def peer_table() -> str:
    sources = Sources()
    lines = [
        "| cell | lora-lab tokens/s (epoch: s) | Unsloth | speed | peak GiB lora-lab / Unsloth | peak ratio "
        "| timing | GPU, date [source] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, what in PEER_ROWS:
        pairs = peer_pairs(name)
        if not pairs:
            lines.append(f"| {what} | not stored | | | | | | |")
            continue
        ours = [p[1] for p in pairs]
        theirs = [p[2] for p in pairs]
        figure, fmt = ("train_seconds", "{:.1f} s") if ours[0].get("train_seconds") else ("tokens_per_s", "{:,.0f}")
        speed = spread([o["tokens_per_s"] / t["tokens_per_s"] for _, o, t in pairs], "{:.2f}x")
        peak = spread([o["peak_reserved_gib"] / t["peak_reserved_gib"] for _, o, t in pairs], "{:.3f}")
        calls = {h["_path"]: h for h, _, _ in pairs}.values()
        when = "; ".join(
            f"{gpu_of(h)}, {h['date'][:10]} {sources.cite(h)}" + (" (earlier code)" if earlier(h) else "")
            for h in calls
        )
        lines.append(
            f"| {what} | {spread([o[figure] for o in ours], fmt)} | {spread([t[figure] for t in theirs], fmt)} "
            f"| {speed} | {spread([o['peak_reserved_gib'] for o in ours], '{:.2f}')} / "
            f"{spread([t['peak_reserved_gib'] for t in theirs], '{:.2f}')} | {peak} "
            f"| {_timing(pairs[0][0], ours[0])} | {when} |"
        )
    return (
        "\n".join(lines)
        + "\n\nUnsloth 2026.10.9 with its recommended settings (LoRA r 8, alpha 32, all linear layers, dropout 0, "
        'use_gradient_checkpointing="unsloth"), lora-lab with its preset and dropout 0 (bench/peer_unsloth.py, '
        "bench/run.py's peer plan); the same random-weight Qwen2.5 folders and samples. Each row is the newest "
        "pair of its cell (up to two runs, each lora-lab figure with the Unsloth figure of its own call), the "
        "spread over those runs. 4 x 1024: Unsloth takes the 4 samples as one micro-batch, lora-lab packs them "
        "into one row. The SFT epoch: 256 samples, lora-lab's 24gb preset (16 samples a step) against "
        "Unsloth with trl's packing into rows of 8192. Peak = torch.cuda.max_memory_reserved.\n\n"
        + sources.render()
        + "\n"
    )


def long_rows() -> list[tuple[dict, dict]]:
    """(header, row) of every stored 7B one-sample cell under a tier's cap (lora-lab's `long-*`
    cells and the long-context plan's Unsloth cells), oldest first."""
    found = []
    for path in sorted(report.RESULTS.glob("*.jsonl")):
        for header, rows in report.runs_of(path):
            header = {**header, "_path": f"bench/results/{path.name}"}
            found += [
                (header, r)
                for r in rows
                if re.match(r"(us-)?long-", r.get("label", "")) and r.get("cap_gib") and r.get("size") == "7b"
            ]
    return sorted(found, key=lambda f: f[0]["date"])


def _four_bit(row: dict) -> bool:
    return bool(row.get("qlora")) or "model.quantization=nf4" in row.get("sets", [])


def _long_cell(row: dict | None, header: dict | None, sources: Sources) -> str:
    if row is None:
        return "not yet stored"
    where = f"{gpu_of(header)}, {header['date'][:10]} {sources.cite(header)}"
    if row.get("error") == "OOM" or "out of" in str(row.get("error")):
        peak = f", {row['peak_reserved_gib']:.2f} GiB reached" if row.get("peak_reserved_gib") else ""
        return f"{row['max_length']:,} tokens: out of memory{peak} ({where})"
    if row.get("error"):
        return f"{row['max_length']:,} tokens: failed ({where})"
    old = ", earlier code" if earlier(header) else ""
    return f"{row['max_length']:,} tokens: {row['peak_reserved_gib']:.2f} GiB ({where}{old})"


def long_context_table() -> str:
    sources = Sources()
    rows = long_rows()
    lines = [
        "| tier (cap), 7B | Unsloth | lora-lab at Unsloth's length | lora-lab, longest stored that trained |",
        "|---|---|---|---|",
    ]
    for tier, four_bit, length in LONG_ROWS:
        mine = [(h, r) for h, r in rows if r.get("preset", tier) == tier and _four_bit(r) == four_bit and r["cap_gib"]]
        mine = [(h, r) for h, r in mine if TIERS[tier] == r["cap_gib"]]
        theirs = [(h, r) for h, r in mine if r["kind"].startswith("unsloth") and r["max_length"] == length]
        ours = [(h, r) for h, r in mine if r["kind"] == "lora-lab"]
        same = [(h, r) for h, r in ours if r["max_length"] == length and not r.get("error")]
        trained = [(h, r) for h, r in ours if not r.get("error")]
        longest = max(trained, key=lambda f: (f[1]["max_length"], f[0]["date"]), default=(None, None))
        cap = TIERS[tier]
        lines.append(
            f"| {tier} ({cap} GiB), {'QLoRA nf4' if four_bit else 'bf16 LoRA'} | "
            + (_long_cell(theirs[-1][1], theirs[-1][0], sources) if theirs else f"{length:,} tokens: not yet stored")
            + f" | {_long_cell(same[-1][1] if same else None, same[-1][0] if same else None, sources)} "
            f"| {_long_cell(longest[1], longest[0], sources)} |"
        )
    return (
        "\n".join(lines) + "\n\nOne full-length sample a step, each cell in its own process under its tier's cap "
        "(LORA_LAB_GPU_MEMORY_GIB; peak = torch.cuda.max_memory_reserved). The Unsloth cells and lora-lab's "
        f"longest ones run in one call: `{LONG_CONTEXT_COMMAND}` (bench/run.py long-context); a cell that runs "
        "out of memory is stored as a row saying so.\n\n" + sources.render() + "\n"
    )


MOE_ROWS = (  # (model, layers kept, its row's name)
    ("qwen3-30b-a3b", 16, "Qwen3-30B-A3B, 16 of its 48 layers"),
    ("gpt-oss-20b", 8, "gpt-oss-20b, 8 of its 24 layers"),
)


def moe_variants(name: str) -> list[tuple[str, str]]:
    """(label suffix, what it trains and how) of bench/run.py's MoE cells of model `name`: the
    experts through liger's fused MoE only where the family has it (registry.Family.liger_experts)."""
    from lora_lab.registry import family_of, model_config_of

    if not family_of(model_config_of(name)["model_type"]).liger_experts:
        return [("-experts", "attention and experts, in low rank on the grouped experts"), ("", "attention")]
    return [
        ("-experts-noliger", "attention and experts, in low rank on transformers' experts (the default)"),
        ("-experts", "attention and experts, through liger's fused MoE (`model.liger_experts=true`)"),
        ("", "attention, through liger's fused MoE (the default)"),
        ("-noliger", "attention, transformers' experts (`model.liger_experts=false`)"),
    ]


def host_of(row: dict) -> str:
    """A cell's peak host RSS, with its anonymous part where the row records it."""
    anonymous = f" ({row['peak_anon_gib']:.1f})" if row.get("peak_anon_gib") else ""
    return f"{row['peak_rss_gib']:.1f}{anonymous}"


def newest_rows(plan: str) -> dict:
    """label -> (the newest stored row of that cell of `plan`, its run's header with the results
    file's path and the run's key "_run": rows of one run came from one call)."""
    newest: dict = {}
    for path in sorted(report.RESULTS.glob(f"*-{plan}.jsonl")):
        for run, (header, rows) in enumerate(report.runs_of(path)):
            for row in rows:
                newest[row["label"]] = (row, {**header, "_path": f"bench/results/{path.name}", "_run": (path, run)})
    return newest


def moe_table() -> str:
    """lora-lab's QLoRA of mixtures of experts beside Unsloth's (bench/run.py moe), the newest
    stored row of each cell; Unsloth's figure stands beside a lora-lab row of the same run (one
    call) that trains as many parameters (its LoRA takes the experts too)."""
    sources = Sources()
    newest = newest_rows("moe")
    lines = [
        "| model, QLoRA nf4, one 2048-token sample a step | LoRA on | lora-lab tokens/s | Unsloth | speed | "
        "peak GiB lora-lab / Unsloth | host RSS (anonymous) GiB lora-lab / Unsloth | GPU, date [source] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, layers, title in MOE_ROWS:
        tag = f"moe-{name}-{layers}L"
        theirs = newest.get(f"us-{tag}", (None, None))
        for suffix, what in moe_variants(name):
            ours, header = newest.get(f"ll-{tag}{suffix}", (None, None))
            if ours is None or ours.get("error"):
                continue
            peer, peer_header = theirs
            paired = (
                peer is not None
                and not peer.get("error")
                and peer["trainable_params"] == ours["trainable_params"]
                and peer_header["_run"] == header["_run"]
            )
            cite = sources.cite(header, lora_lab=True)
            lines.append(
                f"| {title} | {what} ({ours['trainable_params']:,} trained) | {ours['tokens_per_s']:,.0f} | "
                + (
                    f"{peer['tokens_per_s']:,.0f} | {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x | "
                    f"{ours['peak_reserved_gib']:.2f} / {peer['peak_reserved_gib']:.2f} | "
                    f"{host_of(ours)} / {host_of(peer)}"
                    if paired
                    else f"- | - | {ours['peak_reserved_gib']:.2f} / - | {host_of(ours)} / -"
                )
                + f" | {gpu_of(header)}, {header['date'][:10]} {cite} |"
            )
    if len(lines) == 2:
        return ""
    return (
        "\n".join(lines) + "\n\nRandom weights of the published config.json, its first layers only (the 16-bit "
        "checkpoints do not fit the GPU machine's disk), uncapped; lora-lab's 24gb preset with LoRA r 8, alpha 32, "
        "Unsloth 2026.10.9 with its recommended settings (its LoRA on all linear layers takes the experts too). "
        "Host RSS is the process's peak resident memory, the mapped checkpoint's file pages included; in brackets "
        "its anonymous part, without them (recorded since 2026-12-07 15:17). Unsloth's figure "
        "stands only beside a row of the same call.\n\n" + sources.render() + "\n"
    )


GRPO_ROWS = (  # (label tag, its row's name): bench/run.py grpo's cells
    ("16gb-7b", "Qwen2.5-7B QLoRA, 16gb: 16 completions a step, 8 a prompt, 512 tokens"),
    ("8gb-1.5b", "Qwen2.5-1.5B, 8gb: 16 completions a step, 4 a prompt, 256 tokens"),
)
GRPO_VARIANTS = (
    ("", "the preset"),
    ("-nooffload", "checkpoints on the GPU (the plan's choice since)"),
    ("-static", "`grpo.static_cache=true`"),
    ("-static-gpuemb", "`grpo.static_cache=true`, `model.embedding_on_cpu=false`"),
)


def grpo_table() -> str:
    """lora-lab's --task grpo beside Unsloth's GRPO (bench/run.py grpo), the newest stored row of
    each cell; Unsloth's figure stands only beside a lora-lab row of the same run (one call)."""
    sources = Sources()
    newest = newest_rows("grpo")
    lines = [
        "| model, tier's settings | lora-lab | completions/s lora-lab / Unsloth | speed | "
        "step s lora-lab / Unsloth | peak GiB lora-lab / Unsloth | host RSS (anonymous) GiB | GPU, date [source] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tag, title in GRPO_ROWS:
        peer, peer_header = newest.get(f"us-grpo-{tag}", (None, None))
        for suffix, what in GRPO_VARIANTS:
            ours, header = newest.get(f"ll-grpo-{tag}{suffix}", (None, None))
            if ours is None or ours.get("error"):
                continue
            paired = peer is not None and not peer.get("error") and peer_header["_run"] == header["_run"]
            theirs = peer if paired else {}
            lines.append(
                f"| {title} | {what} | {ours['completions_per_s']:.3f} / {_or_dash(theirs, 'completions_per_s', 3)} | "
                + (f"{ours['completions_per_s'] / peer['completions_per_s']:.2f}x" if paired else "-")
                + f" | {ours['median_step_seconds']:.1f} / {_or_dash(theirs, 'median_step_seconds', 1)} | "
                f"{ours['peak_reserved_gib']:.2f} / {_or_dash(theirs, 'peak_reserved_gib', 2)} | "
                f"{host_of(ours)} / {host_of(peer) if paired else '-'} | "
                f"{gpu_of(header)}, {header['date'][:10]} {sources.cite(header, lora_lab=True)} |"
            )
    if len(lines) == 2:
        return ""
    return (
        "\n".join(lines) + "\n\nRandom weights of the published config.json, prompts of 64 words, lora-lab's "
        "`length` reward on both sides, beta 0, DAPO's loss, generation through transformers on both sides "
        "(TRL 1.16 for lora-lab, 1.15 for Unsloth), four steps, the median of the last two. "
        "Completions a second: a step's completions over its median time. Unsloth's figure stands beside a row "
        "of one machine, held between calls.\n\n" + sources.render() + "\n"
    )


def _or_dash(row: dict, key: str, digits: int) -> str:
    return f"{row[key]:.{digits}f}" if row else "-"


def plain_recipe_table() -> str:
    """lora-lab against the plain Trainer+PEFT recipe, each pair from one run."""
    sources = Sources()
    lines = [
        "| workload (Qwen2.5-7B, bf16 LoRA r 8) | plain Trainer+PEFT | lora-lab 24gb preset | speed | "
        "peak GiB plain / lora-lab | GPU, date [source] |",
        "|---|---|---|---|---|---|",
    ]
    headers, rows = report.load("speed")
    for length in sorted({r["max_length"] for r in rows}):
        base = next(r for r in rows if r["kind"] == "baseline" and r["max_length"] == length)
        ours = next(r for r in rows if r["label"] == f"lora-lab-7b-{length}-varlen")
        header = report.headers_of(headers, [ours["label"]])[-1]
        lines.append(
            f"| 4 samples x {length} tokens a step | {base['tokens_per_s']:,.0f} tok/s | "
            f"{ours['tokens_per_s']:,.0f} tok/s | {ours['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{base['peak_reserved_gib']:.2f} / {ours['peak_reserved_gib']:.2f} | "
            f"{gpu_of(header)}, {header['date'][:10]} {sources.cite({**header, '_path': header['_path']})}"
            + (" (earlier code)" if earlier(header) else "")
            + " |"
        )
    headers, rows = report.load("sft-mix")
    for header, run in (
        (h, r) for h in headers[::-1] for r in [_sft_run(h)] if r and r[0] and r[1]
    ):  # the newest run holding both sides
        base, ours = run
        lines.append(
            f"| one epoch of the real-length SFT mix (256 samples) | {base['train_seconds']:.1f} s | "
            f"{ours['train_seconds']:.1f} s | {base['train_seconds'] / ours['train_seconds']:.2f}x | "
            f"{base['peak_reserved_gib']:.2f} / {ours['peak_reserved_gib']:.2f} | "
            f"{gpu_of(header)}, {header['date'][:10]} {sources.cite(header)}"
            + (" (earlier code)" if earlier(header) else "")
            + " |"
        )
        break
    return (
        "\n".join(lines) + "\n\nThe plain recipe is what most fine-tuning scripts reduce to: transformers.Trainer + "
        "peft.get_peft_model, LoRA on all linear layers, micro-batch 1 x gradient accumulation 4 (the SFT "
        "epoch: 16), gradient checkpointing, sdpa attention (bench/baseline.py); lora-lab packs the same "
        "samples into rows of up to 8192 tokens and attends them with flash varlen. Each pair is from one "
        "run.\n\n" + sources.render() + "\n"
    )


def _sft_run(header: dict) -> tuple[dict | None, dict | None] | None:
    """(plain, lora-lab varlen) rows of one stored sft-mix run, or None."""
    path = report.RESULTS / Path(header["_path"]).name
    for h, rows in report.runs_of(path):
        if h["date"] == header["date"]:
            by_label = {r["label"]: r for r in rows if not r.get("error")}
            return by_label.get("baseline-sft-7b-256"), by_label.get("lora-lab-sft-7b-256-varlen")
    return None


def presets_table() -> str:
    """Each preset's cell under its tier's cap, and the plain recipe's peak at the same tokens."""
    sources = Sources()
    headers, rows = report.load_plans("presets-small", "presets-7b", every_file=True)
    sizes = report.SIZES
    lines = [
        "| preset (cap) | " + " | ".join(f"Qwen2.5-{s.upper()}" for s in sizes) + " |",
        "|---" * (len(sizes) + 1) + "|",
    ]

    def cited(row: dict) -> str:
        return sources.cite(report.headers_of(headers, [row["label"]])[-1], lora_lab=row["kind"] == "lora-lab")

    for tier in report.TIERS:
        cells = []
        for size in sizes:
            row = next((r for r in rows if r["kind"] == "lora-lab" and (r["preset"], r["size"]) == (tier, size)), None)
            if row is None:
                cells.append("-")
                continue
            quant = " nf4" if row.get("resolved", {}).get("quantization") == "nf4" else ""
            cells.append(f"{report._cell(row, speed=False)} @{row['max_length']}{quant} {cited(row)}")
        lines.append(f"| {tier} ({TIERS[tier]} GiB) | " + " | ".join(cells) + " |")
    plain = []
    for size in sizes:
        found = [r for r in rows if r["kind"] == "baseline" and r["size"] == size]
        plain.append(
            "; ".join(
                f"{report._cell(r, speed=False)} @{r['max_length']}{' nf4' if r.get('qlora') else ''} {cited(r)}"
                for r in found
            )
            or "-"
        )
    lines.append("| plain Trainer+PEFT, uncapped | " + " | ".join(plain) + " |")
    return (
        "\n".join(lines) + "\n\nPeak GiB (torch.cuda.max_memory_reserved) over 20 optimizer steps of full-length "
        "samples under the tier's cap, packed as the preset packs them (a row of 8192 tokens a step; 8gb 4096, "
        "its 7B 2048) @max_length; several cells shared the GPU, each under its own cap, so no speed is shown. "
        "The plain recipe ran uncapped the same tokens a pass as one sequence, in another run: its peaks do not "
        "depend on lora-lab's code. The preset files' headers quote these rows (tests/unit/test_docs.py).\n\n"
        + sources.render()
        + "\n"
    )


def todays_plans() -> list[tuple[str, str, float, float]]:
    """(group, label, measured peak GiB, today's plan GiB) of every stored single-GPU
    cell the planner is checked on, planned by today's planner as tests/unit/test_memory.py
    plans it (bench/fit_planner.py configures each cell as it ran)."""
    import fit_planner

    from lora_lab.planning.memory import plan_memory

    found: list = []
    groups = (
        ("Qwen2.5, fast LoRA path", lambda: fit_planner.measured_cells(fast_lora=True), None),
        ("Qwen2.5, peft's path", fit_planner.measured_cells, None),
        ("other families", fit_planner.family_cells, None),
        ("DoRA, DPO, ORPO (7B)", fit_planner.tuner_cells, "cap"),
    )
    for group, cells, cap in groups:
        for cell in cells():
            config, peak, label = cell[:3]
            planned = plan_memory(config, gpu_memory_gib=cell[3] if cap else None).total_gib
            found.append((group, label, peak, planned))
    return found


def counted_checks() -> list[tuple[str, str, float, float]]:
    """(group, label, measured peak GiB, today's plan GiB) of the stored cells that check a
    counted (not fitted) term: gradient checkpointing off (bench/run.py speed) and layers not
    recomputed (the peer plan's -keepN cells, in rows of max_length x grad_accum tokens)."""
    import fit_planner

    from lora_lab.config import resolve_config
    from lora_lab.planning.memory import plan_memory

    def planned(row: dict, *more: str) -> float:
        flags = {
            "model.name": f"qwen2.5-{row['size']}",
            "data.datasets": ["x"],
            "data.max_length": row["max_length"],
            "train.grad_accum": row["grad_accum"],
        }
        return plan_memory(resolve_config(row["preset"], flags=flags, sets=fit_planner.cell_sets(row) + list(more)))

    found = []
    _, speed = report.load("speed")
    for row in (r for r in speed if "train.gradient_checkpointing=false" in r.get("sets", []) and not r.get("error")):
        found.append(
            ("gradient checkpointing off (counted)", row["label"], row["peak_reserved_gib"], planned(row).total_gib)
        )
    keep = {}
    for _, cells in peer_files():
        keep.update({label: row for label, row in cells.items() if re.match(r"ll-.*-keep\d+-\d$", label)})
    for label, row in keep.items():
        if not row.get("error"):
            rows = f"data.pack_length={row['max_length'] * row['grad_accum']}"
            found.append(
                ("layers not recomputed (counted)", label, row["peak_reserved_gib"], planned(row, rows).total_gib)
            )
    return found


def planner_table() -> str:
    rows = todays_plans() + counted_checks()
    lines = ["| cells | stored runs | today's plan / measured peak: lowest - highest |", "|---|---|---|"]
    for group in dict.fromkeys(g for g, *_ in rows):
        ratios = [planned / peak for g, _, peak, planned in rows if g == group]
        low = min((r for r in rows if r[0] == group), key=lambda r: r[3] / r[2])
        high = max((r for r in rows if r[0] == group), key=lambda r: r[3] / r[2])
        span = f"{min(ratios):.3f} ({low[1]})" + (f" - {max(ratios):.3f} ({high[1]})" if high is not low else "")
        lines.append(f"| {group} | {len(ratios)} | {span} |")
    return (
        "\n".join(lines) + "\n\nToday's planner (`lora_lab.plan`, planning/memory.py) on every stored cell as it ran "
        "(its preset, length, quantization and the memory means it chose; bench/fit_planner.py), against the "
        "peak that run measured; the newest run of each cell. tests/unit/test_memory.py holds the Qwen2.5 and "
        "tuner cells within 10% and the other families within 10% above and 16% below (they ran earlier "
        "code, before later memory cuts). The counted rows: terms the planner counts rather than fits (rows of 8192 tokens without recomputation; 8 and 14 layers keeping their activations, rows of 4096). Each fitted cell's figures: `python bench/fit_planner.py`.\n"
    )


def families_table() -> str:
    """One row per model: each tier's peak under its cap, with today's plan / peak."""
    sources = Sources()
    plans = {label: planned for group, label, _, planned in todays_plans() if group == "other families"}
    headers, rows = report.load("families", every_file=True)
    rows = [r for r in rows if not r.get("error")]
    lines = [
        "| model | " + " | ".join(f"{tier} ({TIERS[tier]} GiB)" for tier in report.TIERS) + " |",
        "|---" * (len(report.TIERS) + 1) + "|",
    ]
    for model in sorted({r["size"] for r in rows}):
        cells = []
        for tier in report.TIERS:
            row = next((r for r in rows if (r["size"], r["preset"]) == (model, tier)), None)
            if row is None:
                cells.append("-")
                continue
            header = report.headers_of(headers, [row["label"]])[-1]
            precision = "nf4" if row["resolved"]["quantization"] == "nf4" else row["resolved"]["dtype"]
            ratio = plans[row["label"]] / row["peak_reserved_gib"]
            cells.append(
                f"{precision} @{row['max_length']}: {row['peak_reserved_gib']:.2f} ({ratio:.3f}) "
                + sources.cite(header, lora_lab=True)
            )
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return (
        "\n".join(lines) + "\n\nPeak GiB under the tier's cap, in brackets today's plan / that peak. Random weights "
        "from each model's published config.json (lora_lab/model_configs), SmolLM2's tokenizer, 4 optimizer "
        "steps of full-length packed samples with the preset's own choices; the newest run of each cell.\n\n"
        + sources.render()
        + "\n"
    )
