"""--omp-spin-count: what GOMP_SPINCOUNT a worker process is started with."""

from __future__ import annotations

import pytest

from sluice.config import DeviceConfig
from sluice.cpu_binding import worker_environment
from sluice.errors import InvalidConfigError


def spin_env(spec: str, environ: dict[str, str]) -> dict[str, str]:
    env = worker_environment(DeviceConfig(omp_spin_count=spec), environ)
    return {name: env[name] for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if name in env}


def test_auto_sets_ten_thousand_spins_when_the_environment_says_nothing() -> None:
    assert spin_env("auto", {"PATH": "/bin"}) == {"GOMP_SPINCOUNT": "10000"}


@pytest.mark.parametrize("environ", [{"GOMP_SPINCOUNT": "77"}, {"OMP_WAIT_POLICY": "active"}])
def test_auto_keeps_what_the_environment_sets(environ: dict[str, str]) -> None:
    assert spin_env("auto", environ) == environ


def test_inherit_leaves_the_environment_alone() -> None:
    assert spin_env("inherit", {}) == {}
    assert spin_env("inherit", {"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}


def test_a_count_overrides_the_environment() -> None:
    assert spin_env(" 0 ", {}) == {"GOMP_SPINCOUNT": "0"}
    assert spin_env("2500", {"GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": "active"}) == {
        "GOMP_SPINCOUNT": "2500",
        "OMP_WAIT_POLICY": "active",
    }


def test_the_rest_of_the_environment_is_passed_on() -> None:
    env = worker_environment(DeviceConfig(), {"PATH": "/bin", "HOME": "/h"})
    assert env["PATH"] == "/bin" and env["HOME"] == "/h"


@pytest.mark.parametrize("spec", ["lots", "-1", "1e4", ""])
def test_anything_else_is_refused_naming_the_option(spec: str) -> None:
    with pytest.raises(InvalidConfigError, match=r"--omp-spin-count .* is not auto, inherit or a count"):
        worker_environment(DeviceConfig(omp_spin_count=spec), {})
