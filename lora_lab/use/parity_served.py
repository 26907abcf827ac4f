"""The served API as one more form of `lora-lab check` (use/parity.py): an OpenAI-compatible
server (`lora-lab serve`, vLLM, llama.cpp's server) answering for the run.

It is asked what a client asks: each check prompt as a chat message (greedy: temperature 0), and
the trained model's own rendering of the prompt through /v1/completions. The chat answer must
equal the completion of that rendering (the server's chat template renders as the trained one
does), the trained model's greedy answer (as text), and stop where it stops (finish_reason
"stop" where the trained model ended its turn). An API gives no next-token log-probabilities
here, so its rule is the answers: at least MIN_SERVED_ANSWERS of them equal.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from ..errors import LoraLabError

MIN_SERVED_ANSWERS = 0.95
TIMEOUT_S = 300


@dataclass(frozen=True)
class ServedForm:
    """`lora-lab check --served URL [--served-model NAME] [--api-key KEY]`."""

    url: str
    model: str | None = None
    api_key: str | None = None


class ServedSide:
    """One model of an OpenAI-compatible server, read through its HTTP API."""

    def __init__(self, form: ServedForm, tokenizer, run_name: str, tokens: int):
        if not form.url.startswith(("http://", "https://")):
            raise LoraLabError(
                f"--served {form.url}: give the server's http(s) address, e.g. http://127.0.0.1:8000/v1."
            )
        self.url, self.api_key, self.tokenizer, self.tokens = form.url.rstrip("/"), form.api_key, tokenizer, tokens
        names = self._call("GET", "/models", pick=lambda reply: [entry["id"] for entry in reply["data"]])
        self.model = form.model or run_name
        if self.model not in names:
            raise LoraLabError(
                f"--served {form.url}: it serves {', '.join(names) or 'no model'}, not {self.model}; "
                f"name the run's model with --served-model."
            )
        self.chat_answers: dict = {}

    def _call(self, method: str, route: str, body: dict | None = None, pick=lambda reply: reply):
        """`pick` of the route's JSON reply; a reply without what it picks is one clear error."""
        request = urllib.request.Request(
            self.url + route,
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return pick(json.loads(response.read()))
        except (ValueError, KeyError, IndexError, TypeError) as exc:  # not JSON, or not the API's shape
            raise LoraLabError(
                f"--served {self.url}: {route} did not answer as an OpenAI-compatible API does "
                f"({type(exc).__name__}: {str(exc)[:200]}); check the URL (it ends in /v1)."
            ) from None
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise LoraLabError(f"--served {self.url}: {route} answered HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise LoraLabError(
                f"--served {self.url}: cannot reach it ({reason}). Start it (`lora-lab serve RUN_DIR`) or fix the URL "
                f"(it ends in /v1)."
            ) from None

    def ask(self, question: str) -> tuple[str, bool]:
        """The chat answer to `question` (greedy) and whether the server ended the turn."""
        if question not in self.chat_answers:
            body = {
                "model": self.model,
                "messages": [{"role": "user", "content": question}],
                "temperature": 0,
                "max_tokens": self.tokens,
            }
            self.chat_answers[question] = self._call(
                "POST",
                "/chat/completions",
                body,
                pick=lambda r: (
                    r["choices"][0]["message"]["content"] or "",
                    r["choices"][0]["finish_reason"] == "stop",
                ),
            )
        return self.chat_answers[question]

    def complete(self, prompt_ids: list[int]) -> str:
        """The greedy completion of the trained model's rendering of a prompt."""
        prompt = self.tokenizer.decode(prompt_ids)
        body = {"model": self.model, "prompt": prompt, "temperature": 0, "max_tokens": self.tokens}
        return self._call("POST", "/completions", body, pick=lambda r: r["choices"][0]["text"] or "")

    def answer_text(self, answer_ids: list[int], stops: list[int]) -> str:
        """The trained model's answer as the API gives it: without its end-of-turn token."""
        return self.tokenizer.decode([t for t in answer_ids if t not in stops], skip_special_tokens=True)
