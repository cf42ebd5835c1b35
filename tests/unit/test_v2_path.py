"""The modules one v2 classifier request runs through in the router, as docs/architecture.md lists
them: a module joining the path shows up here and in the doc. No Ray: the router's app with a
model that answers at once."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from tests.unit.test_infer_edge import call, router, with_length

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def modules_of_one_request(model_dir: Path) -> list[str]:
    app = router(model_dir)
    body = json.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["great food"]}]}).encode()
    headers = with_length(body, (b"content-type", b"application/json"))
    asyncio.run(call(app, "/v2/models/bert-light/infer", body, headers))  # the first loads what later ones reuse
    seen: dict[str, None] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith("serve_app"):
            seen.setdefault(name, None)

    sys.setprofile(profile)
    try:
        status = asyncio.run(call(app, "/v2/models/bert-light/infer", body, headers))[0]
    finally:
        sys.setprofile(None)
    assert status == 200
    return list(seen)


def test_the_architecture_lists_the_modules_of_a_v2_request(tiny_model_dir: Path) -> None:
    section = DOC.read_text().split("<!-- v2 path: begin -->", 1)[1].split("<!-- v2 path: end -->", 1)[0]
    listed = re.findall(r"`(serve_app[\w.]*)`", section)
    ran = modules_of_one_request(tiny_model_dir)
    assert sorted(listed) == sorted(ran), f"the v2 path is now, in order: {ran}"
