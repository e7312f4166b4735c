"""Run ids survive a renamed config key, and the old name still reads.

Every committed result is found by its id (``results/*/runs/<id>.json``), a hash of its config
(``experiments.runner.identity``). ``delay.nesterov_gamma`` became ``delay.ema_beta`` (``config.RENAMED``): the
id hashes it under its first name, and configs, ``--set`` and checkpoints written with the old name still read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bubblefree.config import RENAMED, Config, apply_overrides, config_from_dict, dump_toml, parse_override, read_toml
from bubblefree.errors import UserError
from bubblefree.experiments import get_scale
from bubblefree.experiments.runner import Run, run_id
from bubblefree.experiments.suite_runs import mitigation_knobs
from bubblefree.experiments.sweeps import knob_sweep_runs

ROOT = Path(__file__).resolve().parents[1]
RECORDS = sorted((ROOT / "results").glob("**/runs/*.json"))


def _renamed(config: dict) -> dict:
    """``config`` (``{section: {key: value}}``) with every old key name of :data:`RENAMED` replaced by its new one."""
    out = {section: dict(table) for section, table in config.items()}
    for old, new in RENAMED.items():
        (s_old, k_old), (s_new, k_new) = old.split("."), new.split(".")
        if k_old in out.get(s_old, {}):
            out.setdefault(s_new, {})[k_new] = out[s_old].pop(k_old)
    return out


def test_every_committed_run_keeps_its_id():
    """Each committed run's id, recomputed from the config its JSON stores, is its file name: under the key names
    it was stored with (the old ones: every record predates the rename) and under the new names."""
    assert len(RECORDS) > 100
    stored_old = 0
    for path in RECORDS:
        config = json.loads(path.read_text())["config"]
        stored_old += any(k.split(".")[1] in config.get(k.split(".")[0], {}) for k in RENAMED)
        for form in (config, _renamed(config)):
            assert run_id(Run(config=config_from_dict(form), variant="")) == path.stem, path
    assert stored_old > 100  # the old names were exercised


def test_a_renamed_key_moved_from_its_neutral_value_hashes_under_its_first_name():
    """Away from its neutral value the key enters the id: under its first name, so the runs swept before the rename
    (the mitigations suite's update EMA) keep theirs, and a different value still gives a different id."""
    base = get_scale("cpu").base
    moved = apply_overrides(base, {"delay.correction": "nesterov", "delay.ema_beta": 0.9})
    assert moved.delay.ema_beta == 0.9 == apply_overrides(base, {"delay.nesterov_gamma": 0.9}).delay.ema_beta
    ids = {run_id(Run(config=apply_overrides(moved, {"delay.ema_beta": g}), variant="")) for g in (0.9, 0.95)}
    assert len(ids) == 2
    knobs = [k for k in mitigation_knobs() if k.key in ("delay.nesterov_gamma", "delay.ema_beta")]
    assert len(knobs) == 2
    suite = json.loads((ROOT / "results/cpu/mitigations.json").read_text())
    runs = knob_sweep_runs(get_scale("cpu"), suite["lrs"], knobs)
    assert {r.config.delay.ema_beta for r in runs} == {0.9, 0.95, 0.99}
    assert {run_id(r) for r in runs} <= set(suite["runs"])  # the suite's code finds its committed sweeps


def test_the_old_name_reads_from_a_file_an_override_and_a_checkpoint_with_one_note(tmp_path, capsys, monkeypatch):
    import bubblefree.config as config_module

    monkeypatch.setattr(config_module, "_NOTED", set())
    toml = tmp_path / "old.toml"
    toml.write_text('[delay]\ncorrection = "nesterov"\nnesterov_gamma = 0.9\n')
    from_file = config_from_dict(read_toml(toml), origin=f"config file {toml}")
    assert from_file.delay.ema_beta == 0.9
    assert parse_override(Config(), "delay.nesterov_gamma=0.8") == ("delay.ema_beta", 0.8)
    checkpoint = {"delay": {"correction": "nesterov", "nesterov_gamma": 0.9}}  # a checkpoint's config section
    assert config_from_dict(checkpoint, origin="checkpoint") == from_file
    assert capsys.readouterr().out == "bubblefree: note: delay.nesterov_gamma is now delay.ema_beta\n"  # once
    assert "ema_beta = 0.9" in dump_toml(from_file) and "nesterov_gamma" not in dump_toml(from_file)


def test_both_names_at_once_are_refused():
    with pytest.raises(UserError, match="sets both delay.nesterov_gamma and delay.ema_beta"):
        config_from_dict({"delay": {"nesterov_gamma": 0.9, "ema_beta": 0.8}}, origin="config file x.toml")
