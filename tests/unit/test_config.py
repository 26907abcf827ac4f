"""Config resolution order, sources, collected errors, model specs, presets as data."""

import pytest
import yaml

from lora_lab.config import RunConfig, list_presets, resolve_config
from lora_lab.errors import ConfigError, ModelError
from lora_lab.registry import MODEL_ALIASES, guess_model_size, resolve_model_spec
from lora_lab.run_folder import load_saved_config, save_config

DATA = {"data.datasets": ["self-cognition"], "data.model_name": "A", "data.model_author": "B"}


def test_defaults_then_preset_then_config_then_flags(tmp_path):
    user = tmp_path / "my.yaml"
    user.write_text("lora:\n  rank: 16\n  alpha: 64\ntrain:\n  lr: 5.0e-5\n")
    config = resolve_config(
        "24gb", str(user), {**DATA, "lora.rank": "32"}, ["train.weight_decay=0.01", "lora.alpha=8"]
    )
    assert config.lora.rank == 32 and config.sources["lora.rank"] == "--lora-rank"
    assert config.lora.alpha == 8.0 and config.sources["lora.alpha"] == "--set"
    assert config.train.lr == 5e-5 and config.sources["train.lr"] == f"config {user}"
    assert config.train.grad_accum == 16 and config.sources["train.grad_accum"] == "preset 24gb"
    assert config.train.weight_decay == 0.01
    assert config.train.seed == 42 and "train.seed" not in config.sources
    assert "lora.rank                    = 32" in config.describe()
    assert "(--lora-rank)" in config.describe() and "(preset 24gb)" in config.describe()


def test_all_problems_are_reported_together_naming_the_flag_or_key(tmp_path):
    user = tmp_path / "bad.yaml"
    user.write_text("lora:\n  rnak: 4\ntrainer:\n  lr: 1\n")
    with pytest.raises(ConfigError) as caught:
        resolve_config(
            "cpu", str(user), {"lora.rank": "0", "train.epochs": "many", "data.truncation": "middle"}, ["train.lr"]
        )
    problems = caught.value.problems
    text = "\n".join(problems)
    assert f"{user}: lora.rnak: unknown key `lora.rnak`. Did you mean `lora.rank`?" in text
    assert f"{user}: unknown section `trainer`" in text
    assert "--set train.lr: expected key=value" in text
    assert "--epochs many: expected a number, got 'many'." in text
    assert "--lora-rank 0: must be at least 1; got 0." in text
    assert "--truncation middle: must be one of truncate, drop; got 'middle'." in text
    assert "--data: no training data" in text
    assert len(problems) == 7


def test_unknown_preset_suggests_the_closest():
    with pytest.raises(
        ConfigError,
        match=r"--preset 16g: no such preset. Did you mean "
        r"--preset 16gb\?",
    ):
        resolve_config("16g", flags=DATA)


def test_preset_picks_settings_per_model_size():
    small = resolve_config("16gb", flags={**DATA, "model.name": "qwen2.5-1.5b"})
    large = resolve_config("16gb", flags={**DATA, "model.name": "Qwen/Qwen2.5-7B-Instruct"})
    assert small.model.quantization == "none"
    assert large.model.quantization == "nf4"
    assert large.sources["model.quantization"] == "preset 16gb (sizes.7b)"
    forced = resolve_config("16gb", flags={**DATA, "model.name": "qwen2.5-7b", "model.quantization": "none"})
    assert forced.model.quantization == "none"


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("qwen2.5-7b", ("hub", "Qwen/Qwen2.5-7B-Instruct")),
        ("Qwen2.5-0.5B", ("hub", "Qwen/Qwen2.5-0.5B-Instruct")),
        ("qwen2.5-3b-base", ("hub", "Qwen/Qwen2.5-3B")),
        ("Qwen/Qwen2.5-1.5B-Instruct", ("hub", "Qwen/Qwen2.5-1.5B-Instruct")),
    ],
)
def test_model_aliases_and_hub_ids(spec, expected):
    assert resolve_model_spec(spec) == expected


@pytest.mark.parametrize("spec", ["qwen2.5-1.8b", "Qwen/Qwen2.5-1.8B-Instruct"])
def test_no_qwen25_1_8b(spec):
    with pytest.raises(
        ModelError,
        match=r"Qwen2.5 has no 1.8B size \(1.8B is a Qwen1.5 size\)"
        r".*try --model qwen2.5-1.5b",
    ):
        resolve_model_spec(spec)


def test_local_folders_and_missing_paths(tmp_path, tiny_model_dir):
    assert resolve_model_spec(str(tiny_model_dir)) == ("folder", str(tiny_model_dir))
    with pytest.raises(ModelError, match="no such folder"):
        resolve_model_spec(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="GGUF file not found"):
        resolve_model_spec(str(tmp_path / "x.gguf"))


def test_model_size_is_known_from_names_and_folder_shapes(tmp_path):
    import json

    from lora_lab.registry import known_model_config

    assert guess_model_size("qwen2.5-7b") == "7b"
    assert guess_model_size("Qwen/Qwen2.5-0.5B-Instruct") == "0.5b"
    folder = tmp_path / "my-finetune"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(known_model_config("3b")))
    assert guess_model_size(str(folder)) == "3b"
    assert set(MODEL_ALIASES) >= {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b"}


@pytest.mark.parametrize("preset", [p["name"] for p in list_presets()])
def test_every_preset_parses_and_validates(preset):
    text = (list_presets()[0]["path"].parent / f"{preset}.yaml").read_text()
    assert text.startswith(f"# lora-lab preset: {preset}")
    assert "lora-lab run --preset " + preset in text
    data = yaml.safe_load(text)
    assert data["description"]
    for size in ("0.5b", "7b"):
        config = resolve_config(preset, flags={**DATA, "model.name": f"qwen2.5-{size}"})
        assert isinstance(config, RunConfig)


def test_saved_config_round_trips(tmp_path):
    config = resolve_config("24gb", flags={**DATA, "lora.rank": "4", "model.name": "qwen2.5-3b"})
    save_config(config, tmp_path / "config.yaml")
    again = load_saved_config(tmp_path / "config.yaml")
    assert again.to_dict() == config.to_dict()
    assert again.sources["lora.rank"] == "--lora-rank"


def test_tuner_full_defaults_and_refusals():
    from lora_lab.errors import ConfigError, ModelError
    from lora_lab.models.load import Precision
    from lora_lab.models.lora import check_full_finetuning_precision

    flags = {"data.datasets": ["x"], "train.tuner": "full"}
    config = resolve_config("24gb", flags=flags)
    assert config.train.lr == 1e-5 and config.sources["train.lr"] == "--tuner full default"
    assert resolve_config("24gb", flags={**flags, "train.lr": 3e-5}).train.lr == 3e-5
    assert resolve_config("24gb", flags={"data.datasets": ["x"]}).train.tuner == "lora"
    with pytest.raises(ConfigError, match=r"--tuner full: full fine-tuning in fp16 is refused"):
        resolve_config("24gb", flags={**flags, "model.dtype": "fp16"})
    with pytest.raises(ConfigError, match=r"--tuner full: .*Drop --quantization nf4"):
        resolve_config("24gb", flags={**flags, "model.quantization": "nf4"})
    with pytest.raises(ModelError, match="this GPU has no bf16"):
        check_full_finetuning_precision(Precision("fp16", fp16=True))


def test_impossible_values_are_refused_together():
    with pytest.raises(ConfigError) as refused:
        resolve_config(
            "cpu",
            flags={
                **DATA,
                "train.lr": "nan",
                "lora.rank": "100000000",
                "data.max_length": "99999999999",
                "lora.dropout": "1.5",
                "train.run_name": "../../etc",
            },
        )
    problems = refused.value.problems
    assert problems == [
        "--lr nan: expected a finite number, got 'nan'.",
        "--lora-rank 100000000: must be at most 4,096; got 100,000,000.",
        "--max-length 99999999999: must be at most 1,048,576; got 99,999,999,999.",
        "--lora-dropout 1.5: must be at least 0 and below 1 (a share of the LoRA input zeroed); got 1.5.",
        "--run-name ../../etc: must be one folder name inside --output-dir (no / or ..); got '../../etc'.",
    ]
    for flags in ({"train.lr": "inf"}, {"train.run_name": "a/b"}, {"train.run_name": ".."}):
        with pytest.raises(ConfigError):
            resolve_config("cpu", flags={**DATA, **flags})


def test_uncheckpointed_layers_are_refused_where_layers_are_not_checkpointed_by_lora_lab():
    from lora_lab.errors import ConfigError

    flags = {"data.datasets": ["x"]}
    assert resolve_config("24gb", flags=flags, sets=["train.uncheckpointed_layers=4"]).train.uncheckpointed_layers == 4
    for sets in (["train.gradient_checkpointing=false"], ["train.tuner=full"]):
        with pytest.raises(ConfigError) as refused:
            resolve_config("24gb", flags=flags, sets=sets + ["train.uncheckpointed_layers=4"])
        assert refused.value.problems == [
            "--set train.uncheckpointed_layers=4: serves LoRA in one process with gradient "
            "checkpointing on. Set it to 0 here."
        ]
    with pytest.raises(ConfigError, match="train.uncheckpointed_layers=-1: must be at least 0"):
        resolve_config("24gb", flags=flags, sets=["train.uncheckpointed_layers=-1"])
    with pytest.raises(ConfigError, match=r"expected a whole number \(or auto\), got 'many'"):
        resolve_config("24gb", flags=flags, sets=["train.uncheckpointed_layers=many"])
    with pytest.raises(
        ConfigError,
        match=r"uncheckpointed_layers=29: the model has 28 decoder "
        r"layers: use at most 28, or auto.",
    ):
        resolve_config("24gb", flags={**flags, "model.name": "qwen2.5-7b"}, sets=["train.uncheckpointed_layers=29"])
    # auto means none where lora-lab does not checkpoint the layers, as the other autos do
    full = resolve_config("24gb", flags=flags, sets=["train.tuner=full", "train.uncheckpointed_layers=AUTO"])
    assert full.train.uncheckpointed_layers == "auto"


def test_eval_tasks_need_an_adapter_to_turn_off():
    """train.eval_tasks scores the base by turning the adapter off: a full fine-tuning run is refused."""
    flags = {"data.datasets": ["x"], "train.eval_tasks": "arc_easy", "train.tuner": "full"}
    with pytest.raises(
        ConfigError, match="--eval-tasks arc_easy: scores the base and the fine-tune by turning the adapter"
    ):
        resolve_config("cpu", flags=flags)
    assert resolve_config("cpu", flags={**flags, "train.tuner": "lora"}).train.eval_tasks == ["arc_easy"]
