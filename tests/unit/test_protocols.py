"""Wire formats without Ray: the v2 binary tensor extension (checked against tritonclient's own
encoders), encoded images, and OpenAI request models."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from serve_app.errors import InvalidInput
from serve_app.protocols import openai, v2, v2_render
from serve_app.protocols.images import decode_image


def _binary_body(tensors: list[tuple[str, str, np.ndarray, bytes]], **extra) -> tuple[bytes, str]:
    header = {
        "inputs": [
            {"name": n, "datatype": dt, "shape": list(a.shape), "parameters": {"binary_data_size": len(blob)}}
            for n, dt, a, blob in tensors
        ],
        **extra,
    }
    head = json.dumps(header).encode()
    return head + b"".join(blob for *_, blob in tensors), str(len(head))


def test_binary_numeric_and_bytes_tensors_round_trip_tritonclient_encoding():
    image = np.random.default_rng(0).random((2, 3, 4, 4), dtype=np.float32)
    texts = np.array(["héllo".encode(), b"", b"x" * 300], dtype=object)
    body, n = _binary_body(
        [("image", "FP32", image, image.tobytes()), ("text", "BYTES", texts, serialize_byte_tensor(texts).item())]
    )
    req = v2.parse_request(body, n)
    np.testing.assert_array_equal(v2.decode_numeric(req.inputs[0]), image)
    assert v2.decode_bytes(req.inputs[1]) == ["héllo", "", "x" * 300]


def test_binary_tensors_are_views_of_the_body_not_copies():
    # A body of megabytes (a request of images) copied per slice would hold up the router's loop.
    image = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
    pngs = np.array([b"\x89PNG" + b"a" * 1000, b"\x89PNG" + b"b" * 2000], dtype=object)
    encoded, n = _binary_body(
        [("image", "FP32", image, image.tobytes()), ("image", "BYTES", pngs, serialize_byte_tensor(pngs).item())]
    )
    body = bytearray(encoded)  # as the router's fast path reads a body of several chunks
    req = v2.parse_request(body, n)
    whole = np.frombuffer(body, dtype=np.uint8)
    pixels = v2.decode_numeric(req.inputs[0])
    np.testing.assert_array_equal(pixels, image)
    assert np.shares_memory(pixels, whole) and not pixels.flags.writeable  # nothing downstream writes into the body
    elements = [e for e in v2.decode_raw_bytes(req.inputs[1]) if isinstance(e, memoryview)]
    assert [bytes(e) for e in elements] == list(pngs)  # every element a view, and the right bytes
    assert all(np.shares_memory(np.frombuffer(e, np.uint8), whole) for e in elements)


def test_binary_texts_decode_from_their_views_and_bad_utf8_names_its_element():
    texts = np.array(["héllo".encode(), b"ok", b"\xff"], dtype=object)
    body, n = _binary_body([("text", "BYTES", texts, serialize_byte_tensor(texts).item())])
    with pytest.raises(InvalidInput, match=r"element 2 is not valid UTF-8 \(invalid start byte at byte 0\)"):
        v2.decode_bytes(v2.parse_request(bytearray(body), n).inputs[0])
    texts = texts[:2]
    body, n = _binary_body([("text", "BYTES", texts, serialize_byte_tensor(texts).item())])
    assert v2.decode_bytes(v2.parse_request(bytearray(body), n).inputs[0]) == ["héllo", "ok"]


def test_json_body_still_parses_without_the_header():
    body = json.dumps({"inputs": [{"name": "t", "shape": [2], "datatype": "INT64", "data": [[1], [2]]}]}).encode()
    assert v2.decode_numeric(v2.parse_request(body, None).inputs[0]).tolist() == [1, 2]


@pytest.mark.parametrize(
    ("body", "header", "needle"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"\xff\xfe", None, "not valid JSON"),
        (b'{"inputs": []}', None, "at least 1 item"),
        (b'{"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES"}]}', None, "neither `data` nor"),
        (b'{"inputs": [{"name": "t", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]}', None, "only 0"),
        (b'{"inputs": [{"name": "t", "shape": [1], "datatype": "FP32", "data": [1]}]}xx', "74", "belong to no input"),
        (b"{}", "99", "the body has 2 bytes"),
        (b"{}", "abc", "must be an integer"),
        (
            b'{"inputs": [{"name": "t", "shape": [1], "datatype": "FP32", "data": [1], "parameters": {"binary_data_size": 0}}]}',
            None,
            "both `data` and",
        ),
        (
            b'{"inputs": [{"name": "t", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": -4}}]}',
            None,
            "non-negative",
        ),
    ],
)
def test_malformed_bodies_are_invalid_input(body, header, needle):
    with pytest.raises(InvalidInput, match=needle):
        v2.parse_request(body, header)


def test_binary_sizes_and_bytes_framing_are_checked():
    body, n = _binary_body([("image", "FP32", np.zeros((1, 2), np.float32), b"\0" * 7)])
    with pytest.raises(InvalidInput, match="needs 8 binary bytes, got 7"):
        v2.decode_numeric(v2.parse_request(body, n).inputs[0])
    body, n = _binary_body([("text", "BYTES", np.zeros(1), b"\x09\0\0\0abc")])
    with pytest.raises(InvalidInput, match="past the end"):
        v2.decode_bytes(v2.parse_request(body, n).inputs[0])
    body, n = _binary_body([("text", "BYTES", np.zeros(1), b"\x02\0\0\0\xff\xfe")])
    with pytest.raises(InvalidInput, match="not valid UTF-8"):
        v2.decode_bytes(v2.parse_request(body, n).inputs[0])


def test_json_numeric_data_rejects_strings_and_overflow():
    cases: list[tuple[list[Any], str]] = [
        (["1.0"], "FP32"), ([True], "FP32"), ([300], "UINT8"), ([None], "FP32"), ([{"a": 1}], "FP32"),
    ]  # fmt: skip
    for data, dt in cases:
        tensor = v2.RequestInput(name="t", shape=[1], datatype=dt, data=data)
        with pytest.raises(InvalidInput, match="data is not"):
            v2.decode_numeric(tensor)
    # Nested row-major data is flattened and type-checked like flat data.
    nested = v2.RequestInput(name="t", shape=[2, 2], datatype="FP32", data=[[1, 2.5], [3, 4]])
    assert v2.decode_numeric(nested).tolist() == [[1.0, 2.5], [3.0, 4.0]]
    with pytest.raises(InvalidInput, match="data is not"):
        v2.decode_numeric(v2.RequestInput(name="t", shape=[2, 1], datatype="FP32", data=[[1.0], ["x"]]))


def test_text_length_limit():
    tensor = v2.RequestInput(name="text", shape=[2], datatype="BYTES", data=["ok", "x" * 11])
    with pytest.raises(InvalidInput, match="element 1 has 11 characters; at most 10"):
        v2.decode_bytes(tensor, max_chars=10)


def test_binary_response_is_what_tritonclient_decodes():
    logits = np.arange(6, dtype=np.float32).reshape(3, 2)
    response = v2.InferResponse(model_name="m", outputs=[v2.encode("logits", logits), v2.encode("label", ["a", "bé", ""])])
    request = v2.request_of(
        {
            "inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
            "outputs": [{"name": "logits", "parameters": {"binary_data": True}}, {"name": "label"}],
            "parameters": {"binary_data_output": True},
        }
    )
    binary = v2.binary_outputs(request, ["logits", "label"])
    assert binary == {"logits", "label"}  # per-output default comes from binary_data_output
    body, headers = v2_render.render_response(response, binary)
    n = int(headers[v2.HEADER_LENGTH])
    header = json.loads(body[:n])
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    assert all("data" not in o for o in header["outputs"])
    blob_logits, blob_label = body[n : n + sizes[0]], body[n + sizes[0] :]
    np.testing.assert_array_equal(np.frombuffer(blob_logits, np.float32).reshape(3, 2), logits)
    assert deserialize_bytes_tensor(blob_label).tolist() == [b"a", "bé".encode(), b""]


def test_json_response_unless_binary_is_asked():
    request = v2.request_of({"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": ["x"]}]})
    assert v2.binary_outputs(request, ["a"]) == set()
    body, headers = v2_render.render_response(v2.InferResponse(model_name="m", outputs=[v2.encode("a", ["z"])]), set())
    assert headers["content-type"] == "application/json" and json.loads(body)["outputs"][0]["data"] == ["z"]


def _png(rgb: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt)
    return buf.getvalue()


def test_images_decode_resize_and_accept_base64():
    rgb = np.random.default_rng(1).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    np.testing.assert_array_equal(decode_image(_png(rgb), 8), rgb.transpose(2, 0, 1))
    assert decode_image(base64.b64encode(_png(rgb)).decode(), 4).shape == (3, 4, 4)
    assert decode_image(_png(rgb, "JPEG"), 8).shape == (3, 8, 8)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (b"not an image", "not a PNG or JPEG"),
        ("%%%", "base64"),
        (_png(np.zeros((4, 4, 3), np.uint8))[:20], "cannot decode"),
    ],
)
def test_bad_images_are_invalid_input(value, needle):
    with pytest.raises(InvalidInput, match=needle):
        decode_image(value, 4)


def test_a_jpeg_with_further_pictures_decodes_as_its_first():
    """Cameras write JPEGs with a preview picture inside (MPO to Pillow); the first picture is the image."""
    rgb = np.full((8, 8, 3), 200, np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="MPO", save_all=True, append_images=[Image.new("RGB", (4, 4))])
    assert Image.open(io.BytesIO(buf.getvalue())).format == "MPO"
    assert np.abs(decode_image(buf.getvalue(), 8).astype(int) - 200).max() <= 2


def _photo(px: int) -> np.ndarray:
    y, x = np.mgrid[0:px, 0:px] / px
    return (np.stack([np.sin(6 * x), np.cos(5 * y), np.sin(3 * (x + y))], axis=-1) * 100 + 128).astype(np.uint8)


def _reference(encoded: bytes, size: int) -> np.ndarray:
    """A full decode and a plain bilinear resize, as the router did before."""
    img = Image.open(io.BytesIO(encoded)).convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(img).transpose(2, 0, 1).astype(int)


def test_a_large_jpeg_decodes_at_a_reduced_scale_and_a_large_png_resizes_in_two_steps(monkeypatch):
    from PIL import JpegImagePlugin

    from serve_app.protocols import images

    drafts: list[object] = []  # what each JPEG draft did: None when it changed nothing
    draft = JpegImagePlugin.JpegImageFile.draft
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", lambda self, *a: drafts.append(draft(self, *a)))
    for fmt in ("JPEG", "PNG"):
        encoded = _png(_photo(512), fmt)
        got = decode_image(encoded, 32).astype(int)
        assert got.shape == (3, 32, 32)
        assert np.abs(got - _reference(encoded, 32)).mean() < 2.0  # what the model sees barely moves
    assert len(drafts) == 1 and drafts[0] is not None  # the JPEG decoded at a reduced scale; PNG has none
    assert images.REDUCING_GAP >= 2.0


@pytest.mark.parametrize("mode", ["L", "CMYK", "RGBA", "P"])
def test_images_of_other_colour_modes_decode_to_rgb(mode):
    pixels = Image.fromarray(_photo(256)).convert(mode)
    fmt = "JPEG" if mode in ("L", "CMYK") else "PNG"
    buf = io.BytesIO()
    pixels.save(buf, format=fmt)
    got = decode_image(buf.getvalue(), 32).astype(int)
    assert got.shape == (3, 32, 32)
    assert np.abs(got - _reference(buf.getvalue(), 32)).mean() < 3.0


def test_one_requests_images_are_bounded_in_pixels_before_any_is_decoded(monkeypatch):
    from serve_app.protocols import images

    monkeypatch.setattr(images, "MAX_REQUEST_PIXELS", 150)
    decoded: list[int] = []
    monkeypatch.setattr(images, "_pixels", lambda img, size, index: decoded.append(index))
    small = _png(np.zeros((8, 8, 3), np.uint8))  # 64 pixels each
    with pytest.raises(InvalidInput, match="192 pixels in one request's images; at most 150"):
        images.decode_images([small, small, small], 4)
    assert decoded == []  # refused from the headers alone


def test_gif_is_refused_by_format():
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="GIF")
    with pytest.raises(InvalidInput, match="format GIF is not accepted"):
        decode_image(buf.getvalue(), 4)


def test_chat_prompt_and_sampling():
    req = openai.ChatCompletionRequest(
        model="gpt",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=4,
        max_completion_tokens=6,
        seed=10,
        n=2,
        stop="x",
    )
    assert req.prompt() == "system: be brief\nuser: hi\nassistant:"
    assert req.sampling(1, "high") == {
        "max_tokens": 6,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "stop": ["x"],
        "seed": 11,
        "ignore_eos": False,
        "priority": "high",
    }


def test_a_replica_error_keeps_its_retry_after_through_rays_wrapper():
    """Ray re-raises a replica's Overloaded in the router as RayTaskError(Overloaded) with args
    (original,); the 503 must still carry the original's message and Retry-After."""
    from ray.exceptions import RayTaskError

    from serve_app.errors import Overloaded
    from serve_app.protocols.errors import error_response

    wrapped = RayTaskError("generate", "traceback", Overloaded("16 wait", retry_after_s=2.5)).as_instanceof_cause()
    assert isinstance(wrapped, Overloaded)
    resp = error_response("/v1/completions", wrapped)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "3"
    assert json.loads(bytes(resp.body))["error"]["message"] == "16 wait"


@pytest.mark.parametrize(
    ("shape", "needle"),
    [
        ([2**70], "declares"),  # one dimension past int64: no OverflowError (a 500)
        ([2**32, 2**32], "declares"),  # the int64 product wraps to 0: no longer accepted
        ([2**21, 2**21, 2**21], "declares"),
        ([1] * 9, "dimensions"),
        ([2, -1], "negative"),
    ],
)
def test_shapes_are_counted_exactly_and_bounded(shape, needle):
    body = json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "data": [1.0, 2.0]}]}).encode()
    tensor = v2.parse_request(body, None).inputs[0]
    with pytest.raises(InvalidInput, match=needle):
        v2.decode_numeric(tensor)
    with pytest.raises(InvalidInput, match=needle):
        tensor.element_count()


def test_a_truncated_image_is_refused_without_the_decoders_own_words():
    with pytest.raises(InvalidInput) as refused:
        whole = _png(np.random.default_rng(3).integers(0, 255, (64, 64, 3), dtype=np.uint8))
        decode_image(whole[: len(whole) // 2], 4)
    assert "corrupt, truncated or unsupported" in str(refused.value)
    assert "Error" not in str(refused.value)  # no exception class or library text reaches the client


def image_replica(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An image model's replica outside Ray, as a one-CPU replica would see its runtime context."""
    from types import SimpleNamespace

    import ray

    from serve_app.config import ModelConfig
    from serve_app.models.classifier import ImageClassifier

    monkeypatch.setattr(
        ray,
        "get_runtime_context",
        lambda: SimpleNamespace(get_assigned_resources=lambda: {"CPU": 1.0}, get_node_id=lambda: "node"),
    )
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    config = ModelConfig.model_validate({"preset": "resnet-tiny"}).model_dump(mode="json")
    # Ray types @serve.deployment as returning the class; it is a Deployment wrapping it.
    return ImageClassifier.func_or_class("resnet-heavy", str(model_dir / "resnet-heavy"), config)  # type: ignore[attr-defined]


def test_an_idle_replica_whose_session_no_longer_answers_fails_its_health_check(tiny_model_dir, monkeypatch):
    from serve_app.models import classifier
    from serve_app.models.health import Stalled

    replica = image_replica(tiny_model_dir, monkeypatch)
    asyncio.run(replica.check_health())  # just answered (warm-up): no probe needed

    class Broken:
        def run(self, *args: object) -> None:
            raise RuntimeError("device lost")

    healthy_session, replica.session = replica.session, Broken()
    asyncio.run(replica.check_health())  # recently busy: not probed, so not yet seen
    replica.last_answer -= classifier.PROBE_IDLE_S + 1
    with pytest.raises(Stalled, match="failed a probe"):
        asyncio.run(replica.check_health())
    replica.session = healthy_session
    asyncio.run(replica.check_health())  # the probe answers again
    asyncio.run(replica.check_health())


def test_on_a_gpu_an_image_replica_runs_one_batch_shape_whatever_the_batch(tiny_model_dir, monkeypatch):
    """CUDA convolutions keep the cuDNN plan of the last input shape only: every batch, the
    warm-up and the health probe run the same shape, and the padding rows change no answer."""
    from serve_app.models.classifier import Classifier
    from serve_app.padding import batch_buckets

    replica = image_replica(tiny_model_dir, monkeypatch)
    s = replica.manifest.image_size
    rng = np.random.default_rng(0)
    batches = [rng.random((n, 3, s, s), dtype=np.float32) for n in (1, 3, 5)]
    on_cpu = replica._forward_all(batches, replica.session)

    monkeypatch.setattr(Classifier, "_buckets", lambda self, n=None: batch_buckets(n or self.batching.max_batch_size))  # GPU
    shapes: list[tuple[int, ...]] = []

    class Recording:
        def run(self, outputs: Any, feed: dict[str, np.ndarray]) -> Any:
            shapes.append(feed["image"].shape)
            return replica.session.run(outputs, feed)

    size = replica.batching.max_batch_size
    replica._warm(Recording(), replica._buckets())
    for batch in batches:
        replica._forward_all([batch], Recording())
    replica._probe_one_row(Recording())
    assert set(shapes) == {(size, 3, s, s)} and len(shapes) == 1 + len(batches) + 1
    on_gpu = np.concatenate([replica._forward_all([b], Recording()) for b in batches])
    np.testing.assert_allclose(on_gpu, on_cpu, rtol=1e-4, atol=1e-5)


def test_a_binary_output_is_sent_from_its_array_without_a_list_of_values():
    logits = np.arange(6, dtype=np.float32).reshape(3, 2)
    out = v2.encode("logits", logits)
    assert out.data is None  # no Python floats until a JSON body needs them
    body, headers = v2_render.render_response(v2.InferResponse(model_name="m", outputs=[out]), {"logits"})
    n = int(headers[v2.HEADER_LENGTH])
    assert "data" not in json.loads(body[:n])["outputs"][0] and out.data is None
    np.testing.assert_array_equal(np.frombuffer(body[n:], "<f4").reshape(3, 2), logits)
    body, _ = v2_render.render_response(v2.InferResponse(model_name="m", outputs=[out]), set())
    assert json.loads(body)["outputs"][0]["data"] == logits.ravel().tolist()


def test_a_16_bit_greyscale_png_keeps_its_tones():
    """Pillow's own conversion clips 16-bit grey at 255: the picture would come out almost white."""
    ramp = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, format="PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode.startswith("I")
    got = decode_image(buf.getvalue(), 32)
    want = (ramp >> 8).astype(np.uint8)
    for channel in got:
        np.testing.assert_array_equal(channel, want)


def _png_header_only(side: int) -> bytes:
    """A PNG whose header claims side x side pixels, with no pixel data: what a decompression bomb declares."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("side", "needle"),
    [
        (5000, "5000x5000 pixels; at most 16777216 are allowed"),
        # Past Pillow's own warning threshold: still refused by the size, with the size named.
        (10000, "10000x10000 pixels; at most 16777216 are allowed"),
        (20000, "cannot decode it"),  # past twice Pillow's limit, Pillow refuses it itself
    ],
)
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's own, on open
def test_an_image_too_large_is_refused_from_its_header(side, needle):
    with pytest.raises(InvalidInput, match=needle):
        decode_image(_png_header_only(side), 4)


def test_oversized_headers_of_many_sizes_print_nothing_and_leave_nothing_behind():
    """Pillow's warning names the size: without a filter, each new size prints a line and stays in
    the warnings registry for good, a leak that headers of a few bytes would drive."""
    import subprocess

    script = (
        "import sys, warnings\n"
        "from PIL import Image\n"
        "from serve_app.errors import InvalidInput\n"
        "from serve_app.protocols.images import decode_image\n"
        "from tests.unit.test_protocols import _png_header_only\n"
        "for side in range(9500, 9600):\n"
        "    try:\n"
        "        decode_image(_png_header_only(side), 4)\n"
        "    except InvalidInput:\n"
        "        pass\n"
        "print(sum(key != 'version' for key in getattr(Image, '__warningregistry__', {})))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr == "" and done.stdout.split() == ["0"]
