import numpy as np
import pytest

from serve_app.errors import InvalidInput
from serve_app.models.generation.sampling import GenerationParams, StreamingText, sample

LOGITS = np.array([0.1, 3.0, 2.5, -1.0, 0.0])


def test_greedy_picks_argmax():
    assert sample(LOGITS, GenerationParams(), np.random.default_rng(0)) == 1


def test_seed_makes_sampling_reproducible():
    p = GenerationParams(temperature=1.0, seed=7)

    def draws() -> list[int]:
        rng = np.random.default_rng(7)
        return [sample(LOGITS, p, rng) for _ in range(50)]

    a, b = draws(), draws()
    assert a == b and len(set(a)) > 1  # the same sequence, and really sampled


def test_top_k_one_and_tiny_top_p_are_greedy():
    rng = np.random.default_rng(0)
    assert {sample(LOGITS, GenerationParams(temperature=1.5, top_k=1), rng) for _ in range(50)} == {1}
    assert {sample(LOGITS, GenerationParams(temperature=1.5, top_p=0.01), rng) for _ in range(50)} == {1}


def test_top_k_restricts_support():
    rng = np.random.default_rng(0)
    assert {sample(LOGITS, GenerationParams(temperature=2.0, top_k=2), rng) for _ in range(200)} == {1, 2}


def test_a_top_k_wider_than_the_vocabulary_keeps_every_token():
    rng = np.random.default_rng(0)
    wide = {sample(LOGITS, GenerationParams(temperature=5.0, top_k=100_000), rng) for _ in range(500)}
    assert wide == set(range(len(LOGITS)))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"stop": 5}, "stop must be"),
        ({"stop": ["ok", 3]}, "stop must be"),
        ({"stop": {"a": 1}}, "stop must be"),
        ({"top_k": "many"}, "top_k must be a number"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a number"),
        ({"temperature": True}, "temperature must be a number"),
        ({"max_tokens": 10_000}, "max_tokens must be between"),
        ({"max_tokens": 10**400}, "max_tokens must be a number"),  # JSON integers have no size limit
        ({"top_p": -(10**400)}, "top_p must be a number"),
        ({"seed": -1}, "seed must be"),
        ({"seed": "7"}, "seed must be"),
        ({"ignore_eos": "yes"}, "ignore_eos must be"),
    ],
)
def test_raw_parameters_are_checked_with_a_clear_400(raw, message):
    with pytest.raises(InvalidInput, match=message):
        GenerationParams.from_raw(raw, default_max_tokens=16, max_tokens_limit=256)


def test_raw_parameters_take_openai_shapes_and_defaults():
    p = GenerationParams.from_raw({"stop": "\n", "top_k": 100_000, "max_tokens": None, "seed": 3}, 16, 256)
    assert p == GenerationParams(max_tokens=16, top_k=100_000, seed=3, stop=("\n",))


@pytest.mark.parametrize(
    "params",
    [
        GenerationParams(max_tokens=0),
        GenerationParams(temperature=3.0),
        GenerationParams(top_p=0.0),
        GenerationParams(stop=("",)),
    ],
)
def test_invalid_params_are_rejected(params):
    with pytest.raises(InvalidInput):
        params.validate(max_tokens_limit=64)


def test_streaming_text_holds_back_possible_stop_prefix():
    s = StreamingText(stop=("END",))
    assert s.update("hello E") == "hello "
    assert s.update("hello EN") == ""
    assert s.update("hello ENx") == "ENx"  # not a stop after all: released
    assert s.update("hello ENx END and more") == " "
    assert s.stopped and s.text == "hello ENx "


def test_streaming_text_holds_back_partial_utf8():
    s = StreamingText(stop=())
    assert s.update("caf\ufffd") == "caf"
    assert s.update("café") == "é"


def test_streaming_text_stops_at_the_first_stop_string_that_one_token_completes():
    s = StreamingText(stop=("b", "a"))
    assert s.update("x") == "x"
    assert s.update("xba") == ""  # "b" comes first: the text ends before it, not before "a"
    assert s.stopped and s.text == "x"


@pytest.mark.parametrize("temperature", [5e-324, 1e-308, 1e-30])
def test_a_tiny_temperature_samples_the_top_token_instead_of_failing(temperature):
    # A valid temperature (0 < t <= 2) that overflows logits / t: the step must not fail on NaNs.
    logits = np.array([1.0, 3.0, 2.0, 3.0 - 1e-9], dtype=np.float32)
    params = GenerationParams(temperature=temperature, top_k=2, top_p=0.9)
    assert {sample(logits, params, np.random.default_rng(s)) for s in range(20)} <= {1, 3}
    assert sample(logits, GenerationParams(temperature=temperature), np.random.default_rng(0)) in {1, 3}
