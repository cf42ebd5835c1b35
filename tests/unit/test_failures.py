"""What an unexpected exception at the HTTP edge becomes, and what the log says of it."""

from __future__ import annotations

import logging

import pytest
from ray.serve.exceptions import DeploymentUnavailableError

from serve_app.errors import ModelFailure, Unavailable
from serve_app.router.edge.failures import unexpected


class Unstarted(DeploymentUnavailableError):
    """Serve's error as a deployment whose replicas failed to start raises it."""

    def __init__(self) -> None:
        Exception.__init__(self, "deployment 'm' is unavailable: its replicas failed to start")


def test_an_unavailable_deployment_is_a_503_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        error = unexpected("/v2/models/m/infer", Unstarted())
    assert isinstance(error, Unavailable) and error.status_code == 503
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is None and "failed to start" in record.getMessage()


def test_a_fault_is_a_500_naming_only_its_type_and_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        error = unexpected("/v2/models/m/infer", KeyError("secret internals"))
    assert isinstance(error, ModelFailure) and "secret" not in error.message and "KeyError" in error.message
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
