"""`lora-lab serve`: one base model loaded once, each run's LoRA adapter on it as a named peft
adapter, chosen per request by its `model` (the base too, answering with adapters disabled).

Generation holds one lock. Non-streamed requests are batched dynamically: a request that finds
the model busy waits, and whoever takes the lock next generates every waiting request that shares
its sampling settings as one batch (left-padded, at most ServedModels.max_batch rows), each row
under its own adapter (peft's adapter_names; `__base__` for the base). A streamed request, or one
with a seed, runs alone, its adapter set inside the lock, so no request runs under another's
adapter. The HTTP side (FastAPI routes, request shapes, OpenAI's error shape) is serve_api.py."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import LoraLabError, ModelError
from ..log import get_logger
from ..models.load import LoadOptions, choose_precision, load_base_model, load_tokenizer
from ..run_folder import base_model_of, find_adapter
from .infer import adapter_tokenizer_source
from .modelfile import stop_ids

log = get_logger()

API_KEY_ENV = "LORA_LAB_API_KEY"
INSTALL_HINT = "lora-lab serve needs FastAPI and uvicorn: pip install 'lora-lab[serve]'"


@dataclass
class Served:
    """One name a request can ask for: a run's adapter, or the base (adapter None)."""

    name: str
    tokenizer: Any
    stop_ids: list[int]
    adapter: str | None = None
    source: str = ""


@dataclass
class ServedModels:
    """The loaded base model with its adapters, the lock every generation holds, and the
    non-streamed requests waiting to be batched."""

    model: Any
    base_name: str
    entries: dict[str, Served]
    lock: threading.Lock = field(default_factory=threading.Lock)
    max_length: int | None = None
    max_batch: int = 16
    waiting: list = field(default_factory=list)
    waiting_lock: threading.Lock = field(default_factory=threading.Lock)
    batch_sizes: list = field(default_factory=list)
    """The rows of each batched generation, newest last (the last 1000)."""

    def get(self, name: str) -> Served | None:
        return self.entries.get(name)


@dataclass
class Sampling:
    """A request's generation parameters. temperature 0 is greedy; None keeps the model's
    generation_config."""

    max_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one generate call."""
        return (self.temperature, self.top_p)

    def as_kwargs(self) -> dict:
        kwargs: dict = {"max_new_tokens": self.max_tokens}
        if self.temperature == 0:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        elif self.temperature is not None:
            kwargs.update(do_sample=True, temperature=self.temperature)
        if self.top_p is not None and self.temperature != 0:
            kwargs["top_p"] = self.top_p
        return kwargs


def check_address(host: str, api_key: str | None) -> None:
    """Loopback serves without a key; any other address only with one."""
    if api_key:
        return
    loopback = host == "localhost"
    with contextlib.suppress(ValueError):  # a host name other than localhost is not loopback
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    if not loopback:
        raise LoraLabError(
            f"--host {host}: serving beyond this machine needs an API key. Set {API_KEY_ENV} (or pass "
            f"--api-key-file FILE); clients then send it as `Authorization: Bearer KEY`."
        )


def read_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key from --api-key / LORA_LAB_API_KEY, or the first line of --api-key-file."""
    if api_key_file:
        try:
            lines = Path(api_key_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise LoraLabError(f"--api-key-file {api_key_file}: cannot read it ({exc.strerror}).") from None
        api_key = lines[0].strip() if lines else ""
        if not api_key:
            raise LoraLabError(f"--api-key-file {api_key_file}: the file is empty; write the key on its first line.")
    return api_key or None


def require_server_packages() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise LoraLabError(INSTALL_HINT) from None


def _name_and_path(spec: str) -> tuple[str, Path]:
    """RUN_DIR (served as its folder's name) or NAME=RUN_DIR."""
    name, sep, path = spec.partition("=")
    if not sep:
        return Path(spec).resolve().name, Path(spec)
    if not name:
        raise LoraLabError(f"{spec}: give a name before '=' (NAME=RUN_DIR), or pass just RUN_DIR.")
    return name, Path(path)


def served_runs(specs: list[str], base: str | None = None, trust_remote_code: bool = False) -> tuple[list, Any]:
    """The runs to serve, (name, adapter folder, the base its run recorded) each, and the base's
    ModelArgs: each spec a run folder (or adapter folder), optionally NAME=PATH; one base for all
    (the one their configs record, unless --base names it)."""
    if not specs:
        raise LoraLabError("name at least one RUN_DIR to serve.")
    runs = []
    for spec in specs:
        name, path = _name_and_path(spec)
        adapter_dir, run_dir = find_adapter(path)
        runs.append((name, adapter_dir, base_model_of(adapter_dir, run_dir)))
    names = [name for name, _, _ in runs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise LoraLabError(f"two runs would be served as {', '.join(repeated)}: name them apart with NAME=RUN_DIR.")
    bases = {args.name for _, _, args in runs}
    if base is None and len(bases) > 1:
        listed = "; ".join(f"{name}: {args.name}" for name, _, args in runs)
        raise LoraLabError(
            f"the runs were trained on different base models ({listed}). One server serves the adapters "
            f"of one base: serve each base's runs with their own `lora-lab serve` (or pass --base MODEL "
            f"if these are copies of the same model)."
        )
    base_args = dataclasses.replace(
        runs[0][2],
        name=base or runs[0][2].name,
        quantization="none",  # generate on the 16-bit base, whatever trained it
        trust_remote_code=trust_remote_code,  # only the serve command's flag turns it on
    )
    if base_args.name in names:
        raise LoraLabError(f"a run is named {base_args.name}, the base model's name: rename it with NAME=RUN_DIR.")
    return runs, base_args


def load_served_models(
    specs: list[str], base: str | None = None, dtype: str = "auto", trust_remote_code: bool = False
) -> ServedModels:
    """Each spec is a run folder (or adapter folder), optionally NAME=PATH. They must share one
    base model (the one their configs record), unless --base names the model to serve them on."""
    from peft import PeftModel

    runs, base_args = served_runs(specs, base, trust_remote_code)
    names = [name for name, _, _ in runs]
    log.info(f"loading {base_args.name} and {len(runs)} adapter(s): {', '.join(names)}")
    model = load_base_model(base_args, choose_precision(dtype), LoadOptions(for_training=False))
    entries = {}
    for name, adapter_dir, _ in runs:
        try:
            if not isinstance(model, PeftModel):
                model = PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=name)
            else:
                model.load_adapter(str(adapter_dir), adapter_name=name)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ModelError(f"{adapter_dir}: the adapter does not load onto {base_args.name}: {exc}") from None
        tokenizer = load_tokenizer(adapter_tokenizer_source(adapter_dir, base_args), trust_remote_code)
        entries[name] = Served(name, tokenizer, stop_ids(tokenizer, model), adapter=name, source=str(adapter_dir))
    base_tokenizer = load_tokenizer(base_args.name, trust_remote_code)
    entries[base_args.name] = Served(base_args.name, base_tokenizer, stop_ids(base_tokenizer, model))
    model.eval()
    max_length = getattr(model.config, "max_position_embeddings", None)
    return ServedModels(model, base_args.name, entries, max_length=max_length)


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [text.find(s) for s in stops if s and s in text]
    return min(found) if found else None


class _Stopper:
    """Ends generation of a row on its stop strings (`stops`: a list of them per row), or of every
    row when the client went away (a transformers StoppingCriteria; built lazily so this module
    imports without torch)."""

    def __new__(cls, tokenizer, prompt_length: int, stops: list[list[str]], cancel: threading.Event):
        import torch
        from transformers import StoppingCriteria

        class Stopper(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                done = [cancel.is_set()] * input_ids.shape[0]
                for row in range(input_ids.shape[0]):
                    if stops[row] and not done[row]:
                        text = tokenizer.decode(input_ids[row, prompt_length:], skip_special_tokens=True)
                        done[row] = _first_stop(text, stops[row]) is not None
                return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

        return Stopper()


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def generate(
    served: ServedModels,
    entry: Served,
    prompt_ids: list[int],
    sampling: Sampling,
    streamer=None,
    cancel: threading.Event | None = None,
) -> Generation:
    """One completion of prompt_ids under entry's adapter (or none): batched with the others
    waiting (module docstring), or alone when streamed, cancellable or seeded."""
    if streamer is None and cancel is None and sampling.seed is None and hasattr(served.model, "peft_config"):
        return _generate_batched(served, _Waiting(entry, prompt_ids, sampling))
    return _generate_alone(served, entry, prompt_ids, sampling, streamer, cancel)


@dataclass
class _Waiting:
    """A non-streamed request waiting for the lock; its outcome once a batch has run it."""

    entry: Served
    prompt_ids: list[int]
    sampling: Sampling
    done: bool = False
    result: Generation | None = None
    error: BaseException | None = None


def _generate_batched(served: ServedModels, me: _Waiting) -> Generation:
    with served.waiting_lock:
        served.waiting.append(me)
    with served.lock:
        if not me.done:
            with served.waiting_lock:
                batch = [w for w in served.waiting if w.sampling.batch_key() == me.sampling.batch_key()]
                batch = [me] + [w for w in batch if w is not me][: served.max_batch - 1]
                served.waiting = [w for w in served.waiting if not any(w is b for b in batch)]
            _run_batch(served, batch)
    if me.error is not None:
        raise me.error
    assert me.result is not None
    return me.result


def _run_batch(served: ServedModels, batch: list[_Waiting]) -> None:
    """One generate call for the batch (holding the lock); each row's outcome set on it."""
    import torch
    from transformers import StoppingCriteriaList

    try:
        first = batch[0].entry
        longest = max(len(w.prompt_ids) for w in batch)
        pad = first.tokenizer.pad_token_id if first.tokenizer.pad_token_id is not None else first.stop_ids[0]
        rows = [[pad] * (longest - len(w.prompt_ids)) + w.prompt_ids for w in batch]
        mask = [[0] * (longest - len(w.prompt_ids)) + [1] * len(w.prompt_ids) for w in batch]
        input_ids = torch.tensor(rows, device=served.model.device)
        stops = [w.sampling.stop for w in batch]
        stopper = _Stopper(first.tokenizer, longest, stops, threading.Event())
        kwargs = batch[0].sampling.as_kwargs() | {"max_new_tokens": max(w.sampling.max_tokens for w in batch)}
        with torch.no_grad():
            output = served.model.generate(
                input_ids=input_ids,
                attention_mask=torch.tensor(mask, device=input_ids.device),
                adapter_names=[w.entry.adapter or "__base__" for w in batch],
                **kwargs,
                eos_token_id=sorted({i for w in batch for i in w.entry.stop_ids}),
                pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([stopper]),
            )
        served.batch_sizes[:] = [*served.batch_sizes[-999:], len(batch)]
        for row, w in zip(output.tolist(), batch, strict=True):
            w.result = _finished(w.entry, row[longest:], len(w.prompt_ids), w.sampling)
    except Exception as exc:  # each request of the batch answers it
        for w in batch:
            w.error = exc
    finally:
        for w in batch:
            w.done = True


def _finished(entry: Served, new: list[int], prompt_tokens: int, sampling: Sampling) -> Generation:
    """A row's Generation: its new tokens up to its own end (an end-of-turn token, a stop string
    or its max_tokens: a batch generates as far as its longest request)."""
    ends = [i for i, token in enumerate(new) if token in entry.stop_ids]
    new = new[: min(ends[0] + 1, sampling.max_tokens) if ends else sampling.max_tokens]
    text = entry.tokenizer.decode(new, skip_special_tokens=True)
    cut = _first_stop(text, sampling.stop)
    ended = bool(new) and new[-1] in entry.stop_ids
    finish = "stop" if ended or cut is not None or len(new) < sampling.max_tokens else "length"
    return Generation(text if cut is None else text[:cut], prompt_tokens, len(new), finish)


def _generate_alone(
    served: ServedModels,
    entry: Served,
    prompt_ids: list[int],
    sampling: Sampling,
    streamer=None,
    cancel: threading.Event | None = None,
) -> Generation:
    """One completion of prompt_ids under entry's adapter (or none), holding the lock."""
    import torch
    from transformers import StoppingCriteriaList

    model, cancel = served.model, cancel or threading.Event()
    input_ids = torch.tensor([prompt_ids], device=model.device)
    stopper = _Stopper(entry.tokenizer, len(prompt_ids), [sampling.stop], cancel)
    with served.lock:
        if entry.adapter is not None:
            model.set_adapter(entry.adapter)
            adapters = contextlib.nullcontext()
        else:
            adapters = model.disable_adapter()
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        with adapters, torch.no_grad():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                **sampling.as_kwargs(),
                eos_token_id=entry.stop_ids,
                pad_token_id=entry.tokenizer.pad_token_id,
                streamer=streamer,
                stopping_criteria=StoppingCriteriaList([stopper]),
            )
    return _finished(entry, output[0, len(prompt_ids) :].tolist(), len(prompt_ids), sampling)


def stream(served: ServedModels, entry: Served, prompt_ids: list[int], sampling: Sampling):
    """Text pieces as they are generated (stop strings held back until they cannot start one),
    then the finished Generation as the last item. Closing the iterator stops generation."""
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(entry.tokenizer, skip_prompt=True, skip_special_tokens=True)
    cancel, outcome = threading.Event(), {}

    def work():
        try:
            outcome["result"] = generate(served, entry, prompt_ids, sampling, streamer, cancel)
        except Exception as exc:  # reported to the client by the caller
            outcome["error"] = exc
            streamer.end()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    hold = max((len(s) for s in sampling.stop), default=1) - 1
    text, sent = "", 0
    try:
        for piece in streamer:
            text += piece
            cut = _first_stop(text, sampling.stop)
            end = cut if cut is not None else len(text) - hold
            if end > sent:
                yield text[sent:end]
                sent = end
            if cut is not None:
                cancel.set()
                break
    finally:
        cancel.set()  # the client went away or a stop string was seen: stop generating
        worker.join()
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    if len(result.text) > sent:
        yield result.text[sent:]
    yield result


def serve_runs(
    specs: list[str],
    *,
    base: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
) -> None:
    """Load the runs and serve them until interrupted (the address is checked before loading)."""
    require_server_packages()
    check_address(host, api_key)
    import uvicorn

    from .serve_api import build_app

    served = load_served_models(specs, base, dtype, trust_remote_code)
    app = build_app(served, api_key)
    log.info(
        f"serving {', '.join(served.entries)} at http://{host}:{port}/v1"
        + (" (API key required)" if api_key else " (no API key: this machine only)")
    )
    uvicorn.run(app, host=host, port=port, log_level="warning")
