"""The modules here run their apps, one module after the other, on one in-process Ray and Serve."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.serving import shared_serve


@pytest.fixture(scope="package")
def serve_url() -> Iterator[str]:
    yield from shared_serve()
