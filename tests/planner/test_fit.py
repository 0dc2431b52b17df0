"""Profile fits recover known coefficients; a profile refuses another model; bad profile files."""

from __future__ import annotations

import pytest

from pdserve.planner.profile.fit import (
    DecodePoint,
    PrefillPoint,
    ProfileError,
    fit_decode,
    fit_prefill,
    load_profile,
    model_identity,
)
from pdserve.planner.model.simulator import StepModel
from tests.planner.helpers import DECODE, PREFILL, TRANSFER, synthetic_profile


@pytest.fixture
def identity(model_factory):
    return model_identity(model_factory())


def test_fits_recover_the_coefficients_of_exact_points(identity):
    profile = synthetic_profile(identity)
    for fit, truth in ((profile.prefill_fit, PREFILL), (profile.decode_fit, DECODE), (profile.transfer_fit, TRANSFER)):
        assert fit.coefficients == pytest.approx(truth, rel=1e-6)
        assert fit.r2 == pytest.approx(1.0)
        assert fit.mean_relative_error < 1e-9


def test_fits_of_noisy_points_report_their_error(identity):
    profile = synthetic_profile(identity, noise=0.05)
    assert profile.decode_fit.coefficients["batch"] == pytest.approx(DECODE["batch"], rel=0.3)
    assert 0.0 < profile.decode_fit.mean_relative_error < 0.06
    assert profile.decode_fit.r2 < 1.0


def test_a_term_that_fits_below_zero_is_dropped(identity):
    points = synthetic_profile(identity).decode_points
    flat = [p.model_copy(update={"seconds": 0.05 - 1e-7 * p.context}) for p in points]  # context "speeds it up"
    fit = fit_decode(flat)
    assert fit.coefficients["context"] == 0.0
    assert all(value >= 0 for value in fit.coefficients.values())


def test_short_prompts_keep_their_share_of_the_fit():
    """Prompts from 16 to 2,048 tokens, each time 5% off a CPU-like truth (alternating): the fit weighs every
    point by its relative error, so the intercept survives and the shortest prompt is priced within the noise.
    In absolute seconds the long prompts' 5% (0.3 s) swamps the short ones' whole time."""
    truth = {"intercept": 0.08, "tokens": 2.5e-3, "attention": 3e-7}
    points = []
    for i, (length, batch) in enumerate([(16, 1), (64, 1), (128, 1), (256, 1), (512, 1), (1024, 1), (1536, 1),
                                         (2048, 1), (256, 4), (1000, 2)]):
        tokens, attention = length * batch, float(batch * length * length)
        exact = truth["intercept"] + truth["tokens"] * tokens + truth["attention"] * attention
        seconds = exact * (1.05 if i % 2 else 0.95)
        points.append(PrefillPoint(prompt_len=length, batch=batch, tokens=tokens, attention=attention,
                                   seconds=seconds, cpu_seconds=seconds))
    fit = fit_prefill(points)
    assert fit.coefficients["intercept"] == pytest.approx(truth["intercept"], rel=0.3)
    for point in points:
        predicted = fit.predict({"intercept": 1.0, "tokens": point.tokens, "attention": point.attention})
        assert predicted == pytest.approx(point.seconds, rel=0.11)


def test_the_decode_fit_reads_the_context_the_backend_attends():
    """Steps of mixed lengths timed on a padding backend (batch x longest): the padded feature recovers the
    coefficients exactly; the sum of the contexts cannot."""
    shapes = [(1, 20, 20), (4, 100, 40), (8, 1200, 400), (16, 3000, 500), (2, 600, 550), (32, 4000, 300)]
    points = [DecodePoint(batch=b, context=total, longest=longest, seconds=DECODE["intercept"] + DECODE["batch"] * b
                          + DECODE["context"] * b * longest, cpu_seconds=0.0) for b, total, longest in shapes]
    padded, summed = fit_decode(points, pads_to_longest=True), fit_decode(points, pads_to_longest=False)
    assert padded.coefficients == pytest.approx(DECODE, rel=1e-6)
    assert summed.coefficients != pytest.approx(DECODE, rel=0.1) and summed.mean_relative_error > 0.005
    uniform = DecodePoint(batch=4, context=400, seconds=1.0, cpu_seconds=1.0)  # no longest: all alike
    assert uniform.attended(True) == uniform.attended(False) == 400


def test_a_profile_of_another_model_is_refused(identity, model_factory):
    profile = synthetic_profile(identity)
    other = model_identity(model_factory("qwen2"))
    with pytest.raises(ProfileError, match="another model.*architecture"):
        profile.check_model(other, "qwen2 dir")
    profile.check_model(identity, "same dir")  # the same model passes


def test_bad_profile_files_get_a_clear_error(tmp_path, identity):
    with pytest.raises(ProfileError, match="cannot read.*pdserve profile"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"version": 1}')
    with pytest.raises(ProfileError, match="not a pdserve profile"):
        load_profile(tmp_path / "bad.json")
    good = tmp_path / "good.json"
    good.write_text(synthetic_profile(identity).model_dump_json())
    assert load_profile(good).model == identity



@pytest.mark.parametrize(("edit", "says"), [
    (lambda d: d["prefill_fit"]["coefficients"].update(tokens=-0.5), "prefill_fit tokens is -0.5"),
    (lambda d: d["decode_fit"]["coefficients"].update(intercept=float("nan")), "decode_fit intercept is nan"),
    (lambda d: d["transfer_fit"]["coefficients"].update(bytes=float("inf")), "transfer_fit bytes is inf"),
    (lambda d: d.update(transfer_sender_cpu_per_byte=-1e-9), "transfer_sender_cpu_per_byte is -1e-09"),
    (lambda d: d["model"].update(kv_bytes_per_token=-1), "model.kv_bytes_per_token is -1, below 1"),
    (lambda d: d["engine"].update(num_kv_blocks=0), "engine.num_kv_blocks is 0, below 1"),
])
def test_a_hand_edited_profile_with_values_no_measurement_gives_is_refused(tmp_path, identity, edit, says):
    import json

    data = json.loads(synthetic_profile(identity).model_dump_json())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))  # NaN and Infinity as Python writes them, which pydantic reads
    with pytest.raises(ProfileError, match="profile the engine again") as error:
        load_profile(path)
    assert str(error.value).startswith(f"{path}: {says}")

def _with_link_threads(profile, device: str):
    """The profile on `device`, its link points' engine threads at a quarter of their processes' CPU."""
    points = [p.model_copy(update={"sender_thread_cpu_s": p.sender_cpu_s / 4, "receiver_thread_cpu_s": p.receiver_cpu_s / 4})
              for p in profile.transfer_points]
    return profile.model_copy(update={"transfer_points": points, "machine": {**profile.machine, "device": device}})


@pytest.mark.parametrize("device, engine_thread_only", [("cpu", False), ("cuda", True), ("cuda:1", True)])
def test_the_link_cpu_an_engine_pays_is_its_own_threads_where_zmq_has_other_cores(identity, device, engine_thread_only):
    profile = _with_link_threads(synthetic_profile(identity), device)
    model = StepModel.from_profile(profile)
    share = 0.25 if engine_thread_only else 1.0  # a CPU engine's one core also runs zmq's I/O thread
    assert model.sender_cpu_per_byte == pytest.approx(profile.transfer_sender_cpu_per_byte * share)
    assert model.receiver_cpu_per_byte == pytest.approx(profile.transfer_receiver_cpu_per_byte * share)


def test_a_gpu_profile_without_the_threads_cpu_pays_the_whole_process(identity):
    profile = synthetic_profile(identity)  # link points from before the thread's CPU was taken
    profile = profile.model_copy(update={"machine": {**profile.machine, "device": "cuda"}})
    assert StepModel.from_profile(profile).sender_cpu_per_byte == profile.transfer_sender_cpu_per_byte
