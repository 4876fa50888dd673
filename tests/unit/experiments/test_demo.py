"""The demo's checks (stare_jax.experiments.demo.Check, demo_checks, format_checks) on hand-made run folders: each
claim's
value, bound, pass and margin, and the overall verdict line. The demo itself, end to end, is
tests/system/test_demo_claims.py (system tier)."""

import pytest

from stare_jax.experiments.demo import Check, demo_checks, format_checks
from stare_jax.training.metrics import MetricsWriter


@pytest.mark.parametrize(
    "op,value,bound,passed,margin",
    [
        (">=", 0.9, 0.9, True, 0.0),
        (">=", 0.8, 0.9, False, -0.1),
        (">", 0.0, 0.0, False, 0.0),
        (">", 0.5, 0.0, True, 0.5),
        ("<", 0.5, 0.5, False, 0.0),
        ("<", 0.25, 0.5, True, 0.25),
        ("<=", 0.2, 0.2, True, 0.0),
        ("<=", 0.3, 0.2, False, -0.1),
    ],
)
def test_check_pass_and_margin(op, value, bound, passed, margin):
    c = Check("x", value, op, bound)
    assert c.passed is passed and c.margin == pytest.approx(margin) and c.need == f"{op} {bound:g}"


def test_unmeasured_check_fails_without_margin():
    c = Check("x", None, ">=", 0.2)
    assert not c.passed and c.margin is None
    assert "| x | n/a | >= 0.2 | NO |" in format_checks([c])


def _arm(path, entropies, target=0.7, eval_start=0.3, evals=(0.6, 0.7, 0.8)):
    with MetricsWriter(path, tensorboard=False, is_main_process=True) as wr:
        for step, h in enumerate(entropies, 1):
            ev = {}
            if step == 1:
                ev["eval_start/accuracy"] = eval_start
            if step > len(entropies) - len(evals):
                ev["eval/accuracy"] = evals[step - 1 - (len(entropies) - len(evals))]
            wr.log(step, {"entropy": h, "target_entropy": target, **ev})
    return path


def test_demo_checks_values_and_verdict(tmp_path):
    grpo = _arm(tmp_path / "grpo_ds", [1.2] + [0.1] * 19)
    stare = _arm(tmp_path / "stare_o1", [1.2] + [0.7] * 14 + [0.5] * 5, evals=(0.4, 0.4, 0.4))
    checks = {c.name: c for c in demo_checks(grpo, stare)}
    assert checks["GRPO-ds last-10 entropy / first-step entropy"].value == pytest.approx(0.1 / 1.2)
    assert checks["STARE target / first-step entropy"].value == pytest.approx(0.7 / 1.2)
    band = checks["STARE last-quarter steps within +-30% of target"]  # 0.5 is inside [0.49, 0.91]
    assert band.value == pytest.approx(1.0) and band.passed
    gain = checks["STARE held-out accuracy gain (last 3 evals - start)"]
    assert gain.value == pytest.approx(0.1) and not gain.passed and gain.margin == pytest.approx(-0.1)
    text = format_checks(list(checks.values()))
    assert "1 of 6 checks FAIL: STARE held-out accuracy gain" in text


def test_demo_checks_band_failure(tmp_path):
    grpo = _arm(tmp_path / "grpo_ds", [1.2] + [0.1] * 19)
    stare = _arm(tmp_path / "stare_o1", [1.2] + [0.7] * 14 + [0.45] * 5)  # 0.45 < 0.49: out of the band
    band = next(c for c in demo_checks(grpo, stare) if c.name.startswith("STARE last-quarter"))
    assert band.value == pytest.approx(0.0) and band.margin == pytest.approx(-0.9)
    ok = demo_checks(grpo, _arm(tmp_path / "stare_ok", [1.2] + [0.7] * 19))
    assert format_checks(ok).rstrip().endswith(f"all {len(ok)} checks pass")


def test_a_changed_stare_setting_is_the_stare_arms_business(tmp_path):
    """The demo's overrides apply to both arms: a changed STARE setting does not stop the GRPO-ds arm (STARE off:
    it trains the same), and the refusal names the STARE arm; a setting the GRPO-ds arm uses still stops it."""
    from stare_jax.config.loader import load_config, save_config
    from stare_jax.experiments.demo import CONFIGS, SCENARIOS, train_arm
    from stare_jax.training.setup import TrainingError

    (grpo, grpo_file), (stare, stare_file) = SCENARIOS["default"]
    dirs = {}
    for arm, cfg_file in ((grpo, grpo_file), (stare, stare_file)):
        cfg = load_config(CONFIGS / cfg_file, ["total_steps=2"])
        dirs[arm] = tmp_path / arm
        save_config(cfg, dirs[arm])
        (dirs[arm] / "checkpoints" / "2").mkdir(parents=True)  # a finished arm: reused, never trained here
    changed = ["total_steps=2", "rl.stare.target_entropy=0.5"]
    result = train_arm(grpo, load_config(CONFIGS / grpo_file, changed), dirs[grpo], log=lambda _: None)
    assert result["reused"] and result["stopped"] is None
    with pytest.raises(TrainingError, match=rf"{stare} was trained with other settings \(rl.stare.target_entropy"):
        train_arm(stare, load_config(CONFIGS / stare_file, changed), dirs[stare], log=lambda _: None)
    with pytest.raises(TrainingError, match=rf"{grpo} was trained with other settings \(optimizer.lr"):
        train_arm(grpo, load_config(CONFIGS / grpo_file, ["total_steps=2", "optimizer.lr=0.5"]), dirs[grpo])
