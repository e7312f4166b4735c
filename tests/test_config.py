"""Run configuration: presets, TOML round trip, precedence, typed --set overrides, validation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import tomllib
from hypothesis import given, settings, strategies as st

from bubblefree.config import (
    Config,
    apply_overrides,
    config_diff,
    config_from_dict,
    dump_toml,
    field_docs,
    parse_override,
    validate,
)
from bubblefree.errors import UserError
from bubblefree.train.presets import PRESETS, load_config


def roundtrip(config: Config) -> Config:
    return config_from_dict(tomllib.loads(dump_toml(config)))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_toml(name):
    config = PRESETS[name]()
    assert roundtrip(config) == config
    assert config_diff(roundtrip(config), config) == {}


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40), lr=st.floats(allow_nan=False, allow_infinity=False), seed=st.integers(0, 2**62),
       flag=st.booleans())
def test_toml_writer_round_trips_any_scalar(text, lr, seed, flag):
    # Strings with quotes, backslashes, control and non-ASCII characters; floats of any magnitude (exact repr).
    config = apply_overrides(Config(), {"data.cache_dir": text, "optim.lr": lr, "train.seed": seed,
                                        "log.progress": flag})
    back = roundtrip(config)
    assert back.data.cache_dir == text and back.train.seed == seed and back.log.progress is flag
    assert math.copysign(1, back.optim.lr) == math.copysign(1, lr) and back.optim.lr == lr


def test_precedence_preset_then_toml_then_set(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nsteps = 7\n\n[optim]\nlr = 0.5\nname = "adamw"\n')
    config = load_config("smoke", path, ["optim.lr=0.25", "pipeline.schedule=sync"])
    smoke = PRESETS["smoke"]()
    assert config.train.steps == 7  # TOML over the preset
    assert config.optim.lr == 0.25 and config.optim.name == "adamw"  # --set over TOML; TOML over the preset
    assert config.pipeline.schedule == "sync"
    assert config.model.preset == smoke.model.preset and config.train.seq_len == smoke.train.seq_len
    assert load_config() == validate(PRESETS["demo"]())  # bare run = demo


@pytest.mark.parametrize("text, key, value", [
    ("optim.lr=3e-4", "optim.lr", 3e-4), ("optim.lr=3", "optim.lr", 3.0), ("train.steps=12", "train.steps", 12),
    ("log.progress=false", "log.progress", False), ("log.tensorboard=Yes", "log.tensorboard", True),
    ("data.source= /some/path ", "data.source", "/some/path"), ("optim.name=adamw", "optim.name", "adamw"),
])
def test_set_parses_to_the_field_type(text, key, value):
    parsed_key, parsed = parse_override(Config(), text)
    assert (parsed_key, parsed) == (key, value) and type(parsed) is type(value)


@pytest.mark.parametrize("text, expected", [
    ("train.steps=1.5", "int"), ("train.steps=ten", "int"), ("optim.lr=fast", "float"),
    ("log.progress=maybe", "bool"), ("train.seed=", "int"),
])
def test_set_rejects_wrong_types_naming_key_value_and_type(text, expected):
    key, _, raw = text.partition("=")
    with pytest.raises(UserError) as info:
        parse_override(Config(), text)
    message = str(info.value)
    assert key in message and repr(raw) in message and f"expected {expected}" in message


@pytest.mark.parametrize("text, fragments", [
    ("optim.lrr=1", ["optim.lrr", "did you mean optim.lr", "adamw_lr", "weight_decay"]),
    ("optimizer.lr=1", ["optimizer.lr", "did you mean 'optim'", "pipeline"]),
    ("steps=3", ["steps", "sections"]),
    ("train.steps", ["expected section.key=value"]),
])
def test_unknown_keys_list_the_valid_ones(text, fragments):
    with pytest.raises(UserError) as info:
        parse_override(Config(), text)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("toml, fragment", [
    ("[train]\nsteps = \"ten\"\n", "train.steps: 'ten' (expected int in [1, 99999999])"),
    ("[train]\nsteps = true\n", "train.steps: True (expected int"),  # bool is an int in Python, not here
    ("[train]\nsteps = 2.0\n", "train.steps: 2.0 (expected int"),
    ("[log]\nprogress = 1\n", "log.progress: 1 (expected bool)"),
    ("steps = 3\n", "top-level key 'steps'"),
    ("[train]\nstep = 3\n", "did you mean train.steps"),
    ("[train\nsteps = 3\n", "not valid TOML"),
])
def test_bad_toml_is_a_user_error(tmp_path, toml, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(UserError) as info:
        load_config(None, path)
    assert fragment in str(info.value)


def test_int_in_toml_is_fine_for_a_float_field(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text("[optim]\nlr = 1\n")
    lr = load_config(None, path).optim.lr
    assert lr == 1.0 and type(lr) is float


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(None, tmp_path / "nope.toml")


@pytest.mark.parametrize("override, fragment", [
    ("train.steps=0", "train.steps: 0 (must be in [1, 99999999]; a checkpoint's name holds its step in 8 digits)"),
    ("train.batch_size=-4", "train.batch_size: -4 (must be >= 1 and at most what the machine's memory holds)"),
    ("train.seq_len=0", "train.seq_len: 0"),
    ("pipeline.stages=0", "pipeline.stages: 0"),
    ("pipeline.microbatches=-1", "pipeline.microbatches: -1"),
    ("train.eval_every=-1", "train.eval_every: -1 (must be in [0, 2^63-1])"),
    ("optim.lr=-0.1", "optim.lr: -0.1"),
    ("optim.lr=nan", "optim.lr: nan (must be finite and in [0, 3.4e38])"),
    ("train.warmup_frac=1.5", "train.warmup_frac: 1.5 (must be in [0, 1])"),
    ("optim.momentum=1.0", "optim.momentum: 1.0"),
    ("pipeline.schedule=zb", "pipeline.schedule: 'zb'; choose from sync, gpipe"),
    ("pipeline.runtime=mpi", "pipeline.runtime: 'mpi'"),
    ("delay.correction=magic", "delay.correction: 'magic'"),
    ("optim.name=sgd", "optim.name: 'sgd'; choose from adamw, muon"),
    ("data.tokenizer=wordpiece", "data.tokenizer"),
    ("model.preset=lama-5m", "model.preset: 'lama-5m' (did you mean 'llama-5m'?); choose from"),
    ("pipeline.microbatches=3", "train.batch_size: 16 (must be divisible by pipeline.microbatches = 3)"),
    ("delay.ef_beta=1.5", "delay.ef_beta: 1.5 (must be in [0, 1])"),
    ("delay.correction=update-ema", "optim.momentum: -1.0 (the optimizer's default) with delay.correction = "
                                    "update-ema (the correction is the optimizer's momentum"),
    ("delay.correction=update-ema,optim.momentum=0.5", "optim.momentum: 0.5 with delay.correction = update-ema"),
    ("delay.correction=update-ema,optim.name=adan,optim.momentum=0",
     "optim.name: 'adan' with delay.correction = update-ema"),
    ("train.nonfinite=skip,pipeline.runtime=distributed", "train.nonfinite: 'skip' needs pipeline.runtime = 'sim'"),
    ("pipeline.runtime=distributed,pipeline.schedule=wpipe",
     "pipeline.schedule: 'wpipe' (the distributed runtime runs"),
    ("pipeline.runtime=distributed,pipeline.stages=4", "pipeline.microbatches: 2 (2bw keeps two weight versions"),
    ("pipeline.runtime=distributed,pipeline.schedule=1f1b,pipeline.stages=4",
     "pipeline.microbatches: 2 (1f1b needs at least P = 4 microbatches per step and replica"),
])
def test_validate_names_the_bad_key(override, fragment):
    with pytest.raises(UserError) as info:
        load_config("demo", None, override.split(","))
    assert fragment in str(info.value)


@pytest.mark.parametrize("overrides", [
    ["optim.name=soap", "optim.max_precond_dim=500"],
    ["optim.name=mars", "optim.adamw_lr=0.001"],
    ["pipeline.runtime=distributed", "pipeline.schedule=sync", "pipeline.stages=4"],  # GPipe, said once
    ["pipeline.schedule=1f1b", "pipeline.stages=4"],  # the simulation has no microbatch order
    *[["delay.correction=update-ema", "optim.momentum=0", f"optim.name={name}"]
      for name in ("adamw", "muon", "lion", "mars", "soap", "nadamw")],
    ["delay.correction=nesterov"], ["delay.correction=nesterov", "optim.momentum=0.9"],  # its first form: any
])
def test_validate_accepts(overrides):
    load_config("demo", None, overrides)


def test_keys_the_optimizer_does_not_use_are_named():
    from bubblefree.config import unused_keys

    assert unused_keys(load_config("demo", None, ["optim.name=soap", "optim.max_precond_dim=500"])) == []
    assert unused_keys(load_config("demo", None, ["optim.adamw_lr=0.001"])) == []
    assert unused_keys(load_config("demo", None, ["optim.name=adamw", "optim.max_precond_dim=500",
                                                  "optim.adamw_lr=0.001"])) == [
        "optim.adamw_lr = 0.001 does nothing for optim.name = 'adamw' (it applies only to muon and mars)",
        "optim.max_precond_dim = 500 does nothing for optim.name = 'adamw' (it applies only to soap)"]


def test_replica_rules_use_the_replica_count():
    config = load_config("demo", None, ["pipeline.microbatches=4"])
    validate(config, replicas=2)  # 2 microbatches per replica, P = 2
    with pytest.raises(UserError, match="multiple of the 3 replicas"):
        validate(config, replicas=3)
    with pytest.raises(UserError, match="2bw keeps two weight versions"):
        validate(config, replicas=4)


def test_choices_are_the_registries():
    """The config lists the names the registries above it own; each list must be its registry's."""
    from bubblefree.config import CHOICES, DISTRIBUTED_SCHEDULES, KEEPS_MOMENTUM, MOMENTUM_CORRECTIONS, OptimConfig
    from bubblefree.delay import CORRECTIONS
    from bubblefree.distributed import ASYNC_SCHEDULES
    from bubblefree.models import PRESETS as MODEL_PRESETS
    from bubblefree.optim import OPTIMIZERS
    from bubblefree.schedules import SCHEDULES

    assert CHOICES["model.preset"] == tuple(MODEL_PRESETS)
    assert CHOICES["optim.name"] == tuple(OPTIMIZERS)
    assert CHOICES["pipeline.schedule"] == SCHEDULES
    assert CHOICES["delay.correction"] == tuple(CORRECTIONS)
    assert MOMENTUM_CORRECTIONS == tuple(name for name, cls in CORRECTIONS.items() if cls.owns_momentum)
    assert KEEPS_MOMENTUM == tuple(name for name, spec in OPTIMIZERS.items() if not spec.momentum_free)
    assert set(ASYNC_SCHEDULES) <= set(DISTRIBUTED_SCHEDULES) <= set(SCHEDULES)
    only_for = {f.name: f.metadata.get("only_for") for f in dataclasses.fields(OptimConfig)}
    assert set(only_for["adamw_lr"]) == {name for name, spec in OPTIMIZERS.items() if spec.route_key}
    assert set(only_for["max_precond_dim"]) == {name for name, spec in OPTIMIZERS.items() if spec.max_precond_dim}
    assert set(only_for["momentum_decay"]) == {name for name, spec in OPTIMIZERS.items()
                                               if spec.cls.__name__ == "NAdamW"}


@pytest.mark.parametrize("schedule", ["sync", "gpipe", "1f1b", "2bw", "pipedream", "wpipe"])
def test_distributed_rules_are_the_schedule_table(schedule):
    """``validate``'s rules for the runtime are the schedule table's: it runs the schedules with a runtime path,
    and refuses fewer than P microbatches per replica exactly where the spec needs them."""
    from bubblefree.config import DISTRIBUTED_SCHEDULES
    from bubblefree.schedules import SCHEDULE_SPECS

    spec = SCHEDULE_SPECS[schedule]
    assert (schedule in DISTRIBUTED_SCHEDULES) == (spec.runtime is not None)
    config = Config()
    config.pipeline.schedule, config.pipeline.stages, config.train.batch_size = schedule, 4, 8
    for m, enough in ((4, True), (2, False)):
        config.pipeline.microbatches = m
        if spec.runtime is None or (spec.microbatches_per_stage and not enough):
            with pytest.raises(UserError, match="pipeline.(schedule|microbatches)"):
                validate(config, replicas=1)
        else:
            validate(config, replicas=1)


def test_every_field_is_documented_and_typed():
    docs = field_docs()
    assert list(docs) == [f.name for f in dataclasses.fields(Config)]
    for section, rows in docs.items():
        for key, type_name, default, doc in rows:
            assert doc, f"{section}.{key} has no docstring"
            assert type(default).__name__ == type_name, (section, key)


def test_docs_config_reference_is_up_to_date():
    from pathlib import Path

    from bubblefree.config import reference_markdown

    docs = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    assert reference_markdown() in docs, "regenerate the reference in docs/training.md (see its note)"


def test_generated_docs_are_up_to_date():
    from bubblefree.docs import generate

    for path, text in generate().items():
        assert path.read_text(encoding="utf-8") == text, f"{path} is out of date: run python -m bubblefree.docs"
    from bubblefree.docs import stale_results, unbacked_intervals

    assert stale_results() == []  # every results/FOLDER/SUITE.md holds the tables of its runs' JSON
    assert unbacked_intervals() == []  # every interval quoted in prose is one a results table holds
