"""engine/env.py: STRATA_* variables read once into a typed record, bad values rejected."""

from __future__ import annotations

import pytest

from engine import env as env_mod


@pytest.fixture
def fresh_env():  # noqa: ANN201
    env_mod.env.cache_clear()
    yield env_mod.env
    env_mod.env.cache_clear()


def test_defaults_and_overrides(fresh_env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    for name in ("STRATA_GEMV_MAX_ROWS", "STRATA_DECODE_KERNEL", "STRATA_TRITON_PDL", "STRATA_XQA_PDL"):
        monkeypatch.delenv(name, raising=False)
    e = fresh_env()
    assert e.gemv_max_rows == 4 and e.decode_kernel == "auto" and e.triton_pdl and not e.xqa_pdl
    fresh_env.cache_clear()
    monkeypatch.setenv("STRATA_GEMV_MAX_ROWS", "1")
    monkeypatch.setenv("STRATA_DECODE_KERNEL", "Triton")
    monkeypatch.setenv("STRATA_TRITON_PDL", "0")
    e = fresh_env()
    assert e.gemv_max_rows == 1 and e.decode_kernel == "triton" and not e.triton_pdl


def test_rejects_a_row_limit_below_one(fresh_env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("STRATA_GEMV_MAX_ROWS", "0")
    with pytest.raises(ValueError, match="STRATA_GEMV_MAX_ROWS"):
        fresh_env()
