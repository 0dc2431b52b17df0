"""The profile's compute dtype against a sweep's: `plan --validate` refuses a known mismatch with the fix, and
profiles or sweeps from before pdserve recorded it load, said so, and are not checked."""

from __future__ import annotations

import json
import logging

import pytest

from pdserve.cli import main
from pdserve.planner.profile.fit import load_profile, model_identity
from tests.planner.helpers import synthetic_profile, write_sweep


def validate(profile_path, sweep_dir, out) -> int:
    return main(["plan", "--profile", str(profile_path), "--validate", str(sweep_dir), "--output-dir", str(out),
                 "--no-plots"])


def test_validate_refuses_a_sweep_whose_engines_computed_in_another_dtype(profile_path, tmp_path, tiny_model, capsys):
    write_sweep(tmp_path / "sweep", tiny_model, load_profile(profile_path), dtype="bfloat16")
    assert validate(profile_path, tmp_path / "sweep", tmp_path / "out") == 2
    error = capsys.readouterr().err
    assert "the profile's engine computed in float32 but the sweep's" in error and "computed in bfloat16" in error
    assert "`pdserve profile --dtype bfloat16`" in error and "--up-args '--dtype float32'" in error
    assert not (tmp_path / "out" / "validation.json").exists()


def test_validate_replays_a_sweep_in_the_profiles_dtype_and_names_it(profile_path, tmp_path, tiny_model, capsys):
    write_sweep(tmp_path / "sweep", tiny_model, load_profile(profile_path), dtype="float32")
    assert validate(profile_path, tmp_path / "sweep", tmp_path / "out") == 0
    printed = capsys.readouterr().out
    assert "the profile's engine: cpu (synthetic; native bf16 no, AMX no), computing in float32" in printed
    assert (tmp_path / "out" / "validation.json").exists()


def test_plan_prints_the_profiles_dtype_in_its_summary(profile_path, tmp_path, capsys):
    assert main(["plan", "--profile", profile_path, "--engines", "2", "--slo", "ttft:60000", "--num-prompts", "20",
                 "--input-len", "32", "--output-len", "8", "--request-rate", "1", "--output-dir", str(tmp_path),
                 "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "computing in float32" in out and "--dtype float32" in out


def old_profile(tmp_path, model_dir):
    """A profile as pdserve wrote it before it recorded the compute dtype and the device's capability."""
    fields = json.loads(synthetic_profile(model_identity(model_dir)).model_dump_json())
    del fields["engine"]["dtype"], fields["capability"]
    path = tmp_path / "old-profile.json"
    path.write_text(json.dumps(fields))
    return path


def test_an_old_profile_loads_as_of_unknown_dtype_said_in_a_log_line(tmp_path, tiny_model, caplog, capsys):
    path = old_profile(tmp_path, tiny_model)
    with caplog.at_level(logging.WARNING):
        profile = load_profile(path)
    assert profile.engine.dtype is None and profile.capability is None
    assert "records no compute dtype and device capability" in caplog.text and "taken as unknown" in caplog.text
    # nothing to check it against: a sweep in any dtype replays, and the up line leaves --dtype to its default
    write_sweep(tmp_path / "sweep", tiny_model, profile, dtype="bfloat16")
    assert validate(path, tmp_path / "sweep", tmp_path / "out") == 0
    assert "computing in an unrecorded dtype" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_a_sweep_without_the_dtype_or_in_the_same_one_is_not_refused(profile_path, tmp_path, tiny_model, dtype):
    write_sweep(tmp_path / "sweep", tiny_model, load_profile(profile_path), dtype=dtype)
    assert validate(profile_path, tmp_path / "sweep", tmp_path / "out") == 0
