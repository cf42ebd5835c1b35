"""The continuous-batching scheduler on the real tiny GPT (ONNX Runtime, no Ray).

The reference is each prompt decoded alone (tests/integration/reference.py); the
scheduler must give the same tokens whatever else shares its steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from serve_app.contract import Priority
from serve_app.errors import ModelFailure
from serve_app.models.generation.continuous import ContinuousScheduler, QueueFull, SchedulerConfig, StepOutcome
from serve_app.models.generation.kv_cache import CacheShape, KVCache, past_names, present_names
from serve_app.models.generation.sampling import GenerationParams
from serve_app.models.generation.sequence import Sequence, TokenEvent
from serve_app.tokenization import TextTokenizer
from tests.integration.reference import greedy_tokens, session

PROMPTS = [
    "the food was",
    "a long story about the weather, the people and the shops in the old town by the river",
    "hi",
    "the service was slow and the",
    "x",
    "good",
    "we waited for an hour and then we left",
]


@dataclass
class Harness:
    """A scheduler over the tiny GPT, with the events each sequence got and the step of each."""

    model_dir: Path
    slots: int = 4
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    fail_next: bool = False

    def __post_init__(self) -> None:
        self.tok = TextTokenizer.from_file(self.model_dir / "gpt" / "tokenizer.json")
        self.meta = json.loads((self.model_dir / "gpt" / "manifest.json").read_text())["generation"]
        self.sess = session(self.model_dir, "gpt")
        m = self.meta
        self.cache = KVCache(CacheShape(m["n_layers"], m["n_heads"], m["head_dim"], m["block_size"]), self.slots)
        self.calls: list[tuple[int, int]] = []  # (batch, T) of every model call
        self.sched = ContinuousScheduler(self.model, self.cache, self.tok.eos_id, self.tok.pad_id, self.tok.decode, self.config)
        self.events: dict[int, list[tuple[int, StepOutcome]]] = {}
        self._ids = 0

    def model(self, ids, pos, mask, past):
        if self.fail_next:
            raise RuntimeError("device lost")
        self.calls.append(ids.shape)
        n = self.meta["n_layers"]
        feeds = {"input_ids": ids, "position_ids": pos, "attention_mask": mask, **dict(zip(past_names(n), past, strict=True))}
        logits, *present = self.sess.run(["logits", *present_names(n)], feeds)
        return logits, present

    def submit(self, prompt: str, max_tokens: int, priority: Priority = Priority.NORMAL, **params) -> Sequence:
        self._ids += 1
        ids = self.tok.encode(prompt) or [self.tok.eos_id]
        p = GenerationParams(max_tokens=max_tokens, **params)
        seq = Sequence(self._ids, ids, p, min(max_tokens, self.meta["block_size"] - len(ids)), priority=int(priority))
        self.sched.submit(seq)
        self.events[seq.id] = []
        return seq

    def step(self) -> None:
        for seq, event in self.sched.step():
            self.events[seq.id].append((self.sched.stats.steps, event))

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            self.step()
        raise AssertionError("did not finish")

    def first_token_delay(self, seq: Sequence) -> int:
        return self.events[seq.id][0][0] - seq.submitted_step

    def tokens(self, seq: Sequence) -> list[int]:
        return seq.tokens


@pytest.fixture
def harness(tiny_model_dir):
    return lambda **kw: Harness(tiny_model_dir, **kw)


def test_greedy_output_equals_decoding_alone_with_staggered_arrivals_and_mixed_lengths(harness, tiny_model_dir):
    """Seven prompts of 1 to ~40 tokens, max_tokens 3 to 40, arriving every other step into 3 slots
    (so some wait), long prompts fed in chunks of 4: each output equals its prompt decoded alone."""
    h = harness(slots=3, config=SchedulerConfig(prefill_chunk=4, prefill_budget=8))
    maxes = [30, 12, 40, 3, 25, 18, 8]
    seqs = []
    for step in range(400):
        if step % 2 == 0 and step // 2 < len(PROMPTS):
            i = step // 2
            seqs.append(h.submit(PROMPTS[i], maxes[i], ignore_eos=i % 2 == 0))
        if not h.sched.has_work and len(seqs) == len(PROMPTS):
            break
        h.step()
    batches = {b for b, _ in h.calls}
    assert max(batches) == 3 and any(t > 1 for _, t in h.calls), "rows really shared steps and prompts were chunked"
    for i, s in enumerate(seqs):
        ref = greedy_tokens(tiny_model_dir, PROMPTS[i], maxes[i], ignore_eos=i % 2 == 0)
        assert s.tokens == ref, (i, PROMPTS[i])
        events = h.events[s.id]
        assert events[-1][1].finish_reason in ("stop", "length") and all(e.finish_reason is None for _, e in events[:-1])
    assert h.cache.free_slots == 3 and h.sched.snapshot()["finished"] == len(PROMPTS)


def test_a_short_request_gets_its_first_token_within_two_steps_while_long_ones_run(harness):
    """Bound, in decode steps: a request submitted between steps k and k+1 is admitted, prefilled
    and sampled in step k+1 when its prompt fits one chunk, so its first token comes at step k+1
    (delay 1); 2 allows for a prompt split across two chunks."""
    h = harness(slots=4)
    longs = [h.submit(p, 40, ignore_eos=True) for p in PROMPTS[:3]]
    for _ in range(5):
        h.step()
    short = h.submit("good", 3)
    while not short.finished:
        h.step()
    assert h.first_token_delay(short) <= 2
    assert all(not s.finished for s in longs), "the long generations were still running"
    # ...and the long ones kept producing a token every step meanwhile.
    window = range(short.submitted_step + 1, h.sched.stats.steps + 1)
    for s in longs:
        assert [st for st, _ in h.events[s.id] if st in window] == list(window)


def test_a_high_priority_request_preempts_low_priority_work_and_nothing_changes_for_the_victim(harness, tiny_model_dir):
    """All slots run long low-priority generations; a high-priority one still starts within 2
    steps (a low one is swapped out), and the swapped one resumes with exactly its tokens."""
    h = harness(slots=2)
    lows = [h.submit(p, 40, Priority.LOW, ignore_eos=True) for p in PROMPTS[:2]]
    for _ in range(4):
        h.step()
    victim = lows[1]  # the newest arrival of the lowest class
    kv_before, n = h.cache.gather([victim.slot], victim.cached), victim.cached
    high = h.submit(PROMPTS[3], 6, Priority.HIGH)
    low_blocked = h.submit("x", 2, Priority.LOW)  # same class as the running ones: it waits
    h.step()
    assert h.first_token_delay(high) == 1
    assert h.sched.stats.preemptions == 1 and h.sched.snapshot()["swapped"] == 1 and victim.slot is None
    assert not h.events[low_blocked.id]
    while victim.slot is None:
        h.step()
    np.testing.assert_array_equal(h.cache.gather([victim.slot], n), kv_before)  # swapped back bit for bit
    h.run()
    assert victim.preemptions == 1 and lows[0].preemptions == 0
    for s, p in zip(lows, PROMPTS[:2], strict=True):
        assert s.tokens == greedy_tokens(tiny_model_dir, p, 40, ignore_eos=True)
    assert high.tokens == greedy_tokens(tiny_model_dir, PROMPTS[3], 6)


def test_without_preemption_a_full_cache_makes_newcomers_wait_for_a_free_slot(harness):
    h = harness(slots=1, config=SchedulerConfig(preemption=False))
    low = h.submit(PROMPTS[0], 10, Priority.LOW, ignore_eos=True)
    h.step()
    high = h.submit("hi", 2, Priority.HIGH)
    h.run()
    assert h.events[high.id][0][0] > h.events[low.id][-1][0]  # started after the low one ended
    assert h.sched.stats.preemptions == 0


def test_cancelling_frees_the_slot_at_the_next_step(harness):
    h = harness(slots=1)
    gone = h.submit(PROMPTS[0], 40, ignore_eos=True)
    h.step()
    waiting = h.submit("hi", 2)
    h.step()
    assert h.sched.snapshot()["waiting"] == 1 and not h.events[waiting.id]
    gone.cancelled = True
    h.step()  # drops the cancelled sequence, admits the waiting one into its slot, decodes it
    assert h.events[waiting.id] and h.sched.stats.cancelled == 1
    assert gone.slot is None and len(h.events[gone.id]) == 2


def test_a_long_prompt_is_fed_in_chunks_without_stalling_running_decodes(harness):
    """Chunk 4, budget 4: a ~40-token prompt takes ~10 steps to prefill; the running sequence
    gets a token in every one of them, and no model call feeds more than 4 prompt tokens."""
    h = harness(slots=2, config=SchedulerConfig(prefill_chunk=4, prefill_budget=4))
    running = h.submit("x", 40, ignore_eos=True)
    h.step()
    long_prompt = h.submit(PROMPTS[1], 2)
    while not h.events[long_prompt.id]:
        h.step()
    steps = range(long_prompt.submitted_step + 1, h.sched.stats.steps + 1)
    assert len(steps) >= 5
    assert [st for st, _ in h.events[running.id] if st in steps] == list(steps)
    assert max(t for _, t in h.calls) <= 4


def test_seeded_sampling_does_not_depend_on_batch_composition(harness):
    params = {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 1234, "ignore_eos": True}
    alone = harness(slots=1)
    a = alone.submit(PROMPTS[0], 20, **params)
    alone.run()
    crowded = harness(slots=4)
    for p in PROMPTS[1:4]:
        crowded.submit(p, 20, temperature=1.0, seed=7, ignore_eos=True)
    crowded.step()
    b = crowded.submit(PROMPTS[0], 20, **params)
    crowded.run()
    assert a.tokens == b.tokens
    other_seed = harness(slots=1)
    c = other_seed.submit(PROMPTS[0], 20, **{**params, "seed": 99})
    other_seed.run()
    assert c.tokens != a.tokens


def test_the_waiting_queue_is_bounded(harness):
    h = harness(slots=1, config=SchedulerConfig(max_waiting=2))
    h.submit("a", 2)
    h.submit("b", 2)
    with pytest.raises(QueueFull):
        h.submit("c", 2)
    assert h.sched.stats.refused == 1


def test_a_failed_model_call_releases_every_slot(harness):
    h = harness(slots=2)
    seqs = [h.submit(p, 10) for p in PROMPTS[:3]]
    h.step()
    h.fail_next = True
    with pytest.raises(RuntimeError, match="device lost"):
        h.step()
    assert {s.id for s in h.sched.abort_all()} == {s.id for s in seqs}
    assert h.cache.free_slots == 2 and not h.sched.has_work


def test_metrics_report_occupancy_throughput_and_latencies(harness):
    h = harness(slots=4)
    for p in PROMPTS[:4]:
        h.submit(p, 12, ignore_eos=True)
    for _ in range(3):
        h.step()
    snap = h.sched.snapshot()
    assert snap["running"] == 4 and snap["kv_slots_used"] == 4 and 0 < snap["kv_occupancy"] < 1
    assert snap["kv_positions_used"] == sum(s.cached for s in h.sched.running)
    h.run()
    snap = h.sched.snapshot()
    assert snap["generated_tokens"] == 48 and snap["tokens_per_s"] > 0
    assert snap["ttft_ms_p50"] is not None and snap["itl_ms_p99"] is not None
    # Four prompts of ~70 tokens in all against a 64-token prefill budget: one waits a step.
    assert snap["ttft_steps_max"] == 2
    assert snap["running"] == 0 and snap["kv_occupancy"] == 0.0
    assert np.isclose(snap["prefill_tokens"], sum(len(h.tok.encode(p)) for p in PROMPTS[:4]))


def test_merged_events_carry_every_token_and_the_last_state():
    a = TokenEvent("he", 5, 3, 1)
    b = TokenEvent("llo", 6, 3, 2)
    c = TokenEvent("", 7, 3, 3, "length")
    merged = a.merge(b).merge(c)
    assert merged == TokenEvent("hello", 7, 3, 3, "length", tokens=3)


def test_one_failing_sequence_ends_alone_and_the_rest_of_its_batch_decodes_on(tiny_model_dir):
    """A sequence whose own sampling fails gets its error; the ones sharing its steps finish
    with the tokens they get alone (the top_k that once killed a whole step is harmless now)."""
    h = Harness(tiny_model_dir)
    good = [h.submit(p, 8) for p in PROMPTS[:2]]
    wide = h.submit(PROMPTS[2], 8, temperature=1.0, top_k=100_000, seed=1)
    bad = h.submit(PROMPTS[3], 8)
    bad.params = GenerationParams(max_tokens=8, temperature=float("nan"))  # fails inside sample(), mid-batch
    h.run()
    (_, error), *rest = h.events[bad.id]
    assert isinstance(error, ModelFailure) and rest == []
    assert h.sched.stats.failed == 1 and h.cache.free_slots == h.slots
    for prompt, seq in zip(PROMPTS[:2], good, strict=True):
        assert seq.tokens == greedy_tokens(tiny_model_dir, prompt, 8)
    last = h.events[wide.id][-1][1]
    assert isinstance(last, TokenEvent) and last.finish_reason in ("stop", "length")
