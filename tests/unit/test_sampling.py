import numpy as np
import pytest

from serve_app.errors import InvalidInput
from serve_app.models.sampling import GenerationParams, StreamingText, sample

LOGITS = np.array([0.1, 3.0, 2.5, -1.0, 0.0])


def test_greedy_picks_argmax():
    assert sample(LOGITS, GenerationParams(), np.random.default_rng(0)) == 1


def test_seed_makes_sampling_reproducible():
    p = GenerationParams(temperature=1.0, seed=7)
    a = [sample(LOGITS, p, np.random.default_rng(7)) for _ in range(20)]
    b = [sample(LOGITS, p, np.random.default_rng(7)) for _ in range(20)]
    assert a == b


def test_top_k_one_and_tiny_top_p_are_greedy():
    rng = np.random.default_rng(0)
    assert {sample(LOGITS, GenerationParams(temperature=1.5, top_k=1), rng) for _ in range(50)} == {1}
    assert {sample(LOGITS, GenerationParams(temperature=1.5, top_p=0.01), rng) for _ in range(50)} == {1}


def test_top_k_restricts_support():
    rng = np.random.default_rng(0)
    assert {sample(LOGITS, GenerationParams(temperature=2.0, top_k=2), rng) for _ in range(200)} <= {1, 2}


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
