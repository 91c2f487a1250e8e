"""engine/env.py: STRATA_* variables read once into a typed record; kernel switches are gone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine import env as env_mod


@pytest.fixture
def fresh_env():  # noqa: ANN201
    env_mod.env.cache_clear()
    yield env_mod.env
    env_mod.env.cache_clear()


def test_defaults_and_overrides(fresh_env, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # noqa: ANN001
    for name in ("STRATA_CACHE_DIR", "STRATA_LOG_LEVEL", "STRATA_LOG_JSON", "STRATA_DIGEST_EVERY",
                 "STRATA_PROFILE_STEPS"):
        monkeypatch.delenv(name, raising=False)
    e = fresh_env()
    assert e.log_level == "info" and e.log_json is None and e.digest_every == 64 and e.profile_steps is None
    assert e.cache_dir == Path.home() / ".cache" / "strata"
    fresh_env.cache_clear()
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STRATA_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("STRATA_LOG_JSON", "0")
    monkeypatch.setenv("STRATA_DIGEST_EVERY", "8")
    monkeypatch.setenv("STRATA_PROFILE_STEPS", "5:40")
    e = fresh_env()
    assert (e.cache_dir, e.log_level, e.log_json, e.digest_every) == (tmp_path, "debug", False, 8)
    assert e.profile_steps == (5, 40)


@pytest.mark.parametrize(("name", "value", "says"), [
    ("STRATA_DIGEST_EVERY", "abc", "STRATA_DIGEST_EVERY must be an integer"),
    ("STRATA_DIGEST_EVERY", "-1", "STRATA_DIGEST_EVERY must be >= 0"),
    ("STRATA_LOG_LEVEL", "loud", "STRATA_LOG_LEVEL must be"),
    ("STRATA_LOG_JSON", "maybe", "STRATA_LOG_JSON must be 1/true/yes or 0/false/no"),
    # checked at start (an audit: a bad one failed in a GPU worker after it had loaded)
    ("STRATA_PROFILE_STEPS", "garbage", "STRATA_PROFILE_STEPS must be FIRST:COUNT"),
    ("STRATA_PROFILE_STEPS", "0:10", "STRATA_PROFILE_STEPS must be FIRST:COUNT"),
    ("STRATA_PROFILE_STEPS", "3:0", "STRATA_PROFILE_STEPS must be FIRST:COUNT"),
])
def test_bad_values_name_their_variable(fresh_env, monkeypatch: pytest.MonkeyPatch, name: str, value: str,  # noqa: ANN001
                                        says: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=says):
        fresh_env()


def test_no_kernel_switches(fresh_env) -> None:  # noqa: ANN001
    """Kernel choices come from configs/tuning/ and --decode-kernel, not the environment
    (profile_steps only turns on a diagnostic profiler)."""
    fields = {f.name for f in dataclasses.fields(fresh_env())}
    assert fields == {"cache_dir", "log_level", "log_json", "digest_every", "git_commit", "profile_steps", "api_key"}


def test_the_profiler_takes_the_checked_window(fresh_env, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                               tmp_path: Path) -> None:
    from engine.run.step_profile import StepProfiler

    monkeypatch.setenv("STRATA_PROFILE_STEPS", "5")  # COUNT left out: 100
    assert fresh_env().profile_steps == (5, 100)
    profiler = StepProfiler((5, 40), str(tmp_path), 1)
    assert (profiler.first, profiler.count, profiler.path.name) == (5, 40, "profile-rank1.txt")
