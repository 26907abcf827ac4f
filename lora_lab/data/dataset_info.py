"""LLaMA-Factory's dataset_info.json: `--data path/dataset_info.json:NAME` reads entry NAME.

An entry names the file (`file_name`, relative to the dataset_info.json folder) or hub dataset
(`hf_hub_url`, `split`), its `formatting` (alpaca, the default, or sharegpt), `columns` (which
column holds the prompt, query, response, history, system, tools, messages) and, for sharegpt,
`tags` (the role and content keys and the value of each role). Rows are mapped onto lora-lab's
alpaca / sharegpt / text shapes exactly as LLaMA-Factory's data/README.md documents; an entry
with only a `prompt` column is pre-training text. `ranking: true` and a `kto_tag` column are
preference data: read by --task dpo / orpo / simpo / kto (remap_preference), refused by
supervised runs with the task that trains them (preference.refuse_preference).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from .preference import refuse_preference
from .readers import kind_of, read_rows

ALPACA_DEFAULTS = {"prompt": "instruction", "query": "input", "response": "output"}
SHAREGPT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
_TAG_TO_SPEAKER = {
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
_UNSUPPORTED = ("ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


@dataclass
class DatasetInfoEntry:
    info_path: Path
    name: str
    entry: dict
    columns: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)

    @classmethod
    def from_source(cls, source: str) -> DatasetInfoEntry | None:
        """The entry for 'DIR/dataset_info.json:NAME', or None for any other --data form."""
        match = re.fullmatch(r"(.*dataset_info\.json):([^/\\]+)", source)
        if not match:
            return None
        info_path, name = Path(match.group(1)).expanduser(), match.group(2)
        if not info_path.is_file():
            raise DataError(f"--data {source}: {info_path} not found.")
        try:
            info = json.loads(info_path.read_text(encoding="utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise DataError(f"--data {source}: {info_path} is not valid JSON ({exc}).") from None
        if not isinstance(info, dict) or not isinstance(info.get(name), dict):
            names = ", ".join(sorted(info)[:20]) if isinstance(info, dict) else "none"
            raise DataError(f"--data {source}: no dataset `{name}` in {info_path} (it has: {names}).")
        entry = info[name]
        columns, tags = entry.get("columns") or {}, entry.get("tags") or {}
        if (
            not isinstance(columns, dict)
            or not isinstance(tags, dict)
            or not all(isinstance(v, str) for v in [*columns.values(), *tags.values()])
        ):
            raise DataError(f"--data {source}: `columns` and `tags` must map names to column names (text).")
        return cls(info_path, name, entry, columns, {**SHAREGPT_TAGS, **tags})

    @property
    def formatting(self) -> str:
        return self.entry.get("formatting", "alpaca")

    def describe(self) -> str:
        fmt = "text" if self._is_text() else self.formatting
        return f"LLaMA-Factory {fmt} ({self.info_path.name}:{self.name})"

    def read_rows(self, warnings: list, stream: bool = False):
        where = f"--data {self.info_path}:{self.name}"
        if self.entry.get("file_name"):
            path = self.info_path.parent / self.entry["file_name"]
            if path.is_dir():
                raise DataError(
                    f"{where}: file_name {self.entry['file_name']} is a folder; "
                    f"point file_name at one .json / .jsonl / .csv / .parquet file."
                )
            return read_rows(str(path), warnings, stream)
        if self.entry.get("hf_hub_url"):
            split = self.entry.get("split")
            return read_rows(self.entry["hf_hub_url"] + (f":{split}" if split else ""), warnings, stream)
        given = [k for k in _UNSUPPORTED if k in self.entry]
        raise DataError(
            f"{where}: the entry has no file_name or hf_hub_url"
            f"{' (' + ', '.join(given) + ' are not supported)' if given else ''}; "
            f"download the data and set file_name."
        )

    def row_format(self, raw_rows: list, spec: str) -> str:
        """alpaca, sharegpt or text; preference entries are refused here."""
        where = f"--data {spec}"
        if self.entry.get("ranking"):
            refuse_preference({"chosen": None, "rejected": None}, where)
        if "kto_tag" in self.columns:
            refuse_preference({"kto_tag": None}, where)
        if self.formatting not in ("alpaca", "sharegpt"):
            raise DataError(f"{where}: formatting {self.formatting!r}; LLaMA-Factory defines alpaca and sharegpt.")
        return "text" if self._is_text() else self.formatting

    def _is_text(self) -> bool:
        """Pre-training: an alpaca entry whose only column is the prompt (data/README.md)."""
        return self.formatting == "alpaca" and set(self.columns) == {"prompt"}

    def remap(self, row):
        """One row in lora-lab's alpaca / sharegpt / text shape."""
        if not isinstance(row, dict):
            return row
        if self._is_text():
            return {"text": self._column(row, "prompt", required=True)}
        if self.formatting == "sharegpt":
            return self._remap_sharegpt(row)
        columns = {**ALPACA_DEFAULTS, **self.columns}
        out = {"instruction": row.get(columns["prompt"]), "input": row.get(columns["query"])}
        out["output"] = self._column(row, "response", required=True, default="output")
        for key in ("system", "history", "tools"):
            if key in columns:
                out[key] = row.get(columns[key])
        if out["instruction"] is None and out["input"] is None:
            raise DataError(f"missing column `{columns['prompt']}` (dataset_info columns.prompt)")
        return {k: v for k, v in out.items() if v is not None}

    def remap_preference(self, row):
        """A `ranking: true` or `kto_tag` entry's row in pairs.py's shape: LLaMA-Factory's
        columns chosen / rejected (sharegpt: one turn each; alpaca: text) and kto_tag."""
        if not isinstance(row, dict):
            return row
        if self.formatting == "sharegpt":
            out = self._remap_sharegpt(row)
            for key in ("chosen", "rejected"):
                if key in self.columns or self.entry.get("ranking"):
                    turn = row.get(self.columns.get(key, key))
                    out[key] = self._turn(turn) if isinstance(turn, dict) else turn
        else:
            columns = {**ALPACA_DEFAULTS, **self.columns}
            out = {
                "instruction": row.get(columns["prompt"]),
                "input": row.get(columns["query"]),
                "chosen": row.get(self.columns.get("chosen", "chosen")),
                "rejected": row.get(self.columns.get("rejected", "rejected")),
            }
            if "system" in columns:
                out["system"] = row.get(columns["system"])
            if "kto_tag" not in self.columns:
                return {k: v for k, v in out.items() if v is not None or k in ("chosen", "rejected")}
            out["messages"] = [
                {"role": "user", "content": out.pop("instruction")},
                {"role": "assistant", "content": row.get(columns["response"])},
            ]
            out.pop("chosen"), out.pop("rejected"), out.pop("input")
        if "kto_tag" in self.columns:
            out["label"] = row.get(self.columns["kto_tag"])
        return {k: v for k, v in out.items() if v is not None or k in ("chosen", "rejected")}

    def _turn(self, turn: dict) -> dict:
        """A sharegpt turn with the entry's tags, as {"from", "value"}."""
        speakers = {self.tags[tag]: speaker for tag, speaker in _TAG_TO_SPEAKER.items()}
        role = turn.get(self.tags["role_tag"])
        return {"from": speakers.get(role, role), "value": turn.get(self.tags["content_tag"])}

    def _column(self, row: dict, key: str, required: bool = False, default: str | None = None):
        name = self.columns.get(key, default)
        if required and row.get(name) is None:
            raise DataError(f"missing column `{name}` (dataset_info columns.{key})")
        return row.get(name)

    def _remap_sharegpt(self, row: dict) -> dict:
        messages_column = self.columns.get("messages", "conversations")
        turns = row.get(messages_column)
        if not isinstance(turns, list):
            raise DataError(
                f"column `{messages_column}` (dataset_info columns.messages) must be "
                f"a list of turns; got {kind_of(turns)}"
            )
        tags = self.tags
        speakers = {tags[tag]: speaker for tag, speaker in _TAG_TO_SPEAKER.items()}
        conversations = []
        for index, turn in enumerate(turns, start=1):
            if not isinstance(turn, dict):
                raise DataError(f"turn {index}: expected an object, got {kind_of(turn)}")
            role = turn.get(tags["role_tag"])
            if not isinstance(role, str) or role not in speakers:
                shown = repr(role) if isinstance(role, (str, type(None))) else kind_of(role)
                raise DataError(
                    f"turn {index}: `{tags['role_tag']}` is {shown}; the entry's "
                    f"tags allow {', '.join(map(repr, speakers))}"
                )
            conversations.append({"from": speakers[role], "value": turn.get(tags["content_tag"])})
        out: dict[str, object] = {"conversations": conversations}
        starts_with_system = conversations and conversations[0]["from"] == "system"
        if "system" in self.columns and not starts_with_system:  # a system turn overrides it
            out["system"] = row.get(self.columns["system"])
        if "tools" in self.columns:
            out["tools"] = row.get(self.columns["tools"])
        return out
