"""Fixtures of the fleet tests."""

from __future__ import annotations

import pytest

from metaopt.fleet import env

# What a launcher sets; a test of fleet's own environment handling starts without any of it.
WORKER_ENV_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PADDLE_TRAINER_ID",
    "PADDLE_TRAINERS_NUM",
    "PADDLE_TRAINER_ENDPOINTS",
    "PADDLE_CURRENT_ENDPOINT",
    "METAOPT_COMM_TIMEOUT",
)


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, and fleet's state forgotten before and after the test."""
    for name in WORKER_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    env.reset()
    yield
    env.reset()
