"""Plain Ray Serve text generation, as its documentation's streaming-batch example does it: the
generator deployment is its own HTTP ingress, `@serve.batch` over an async generator gathers
prompts and yields one token per row per step, a `StreamingResponse` sends them; no router.

The model work is ours (the same decoder graph call, tokenizer and thread rule), so a gap between
the two is what each serving layer does around the model: request-level against continuous
batching, the router's hop and checks. It speaks just enough of OpenAI's streamed
`/v1/completions` for `benchmarks.genload`: greedy, `max_tokens`, `ignore_eos`, usage per chunk.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import StreamingResponse

from benchmarks.baselines.runner import baseline_session
from serve_app.manifest import Manifest
from serve_app.models.generation.decoder_graph import DecoderGraph
from serve_app.models.runtime import intra_op_threads
from serve_app.padding import pad_left
from serve_app.tokenization import TextTokenizer


@serve.deployment
class PlainGenerator:
    def __init__(
        self, name: str, model_dir: str, max_batch_size: int, batch_wait_timeout_s: float, threads: int | None = None
    ) -> None:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        manifest = Manifest.load(Path(model_dir))
        assert manifest.generation is not None, f"{model_dir}: not a generator"
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        session = baseline_session(Path(model_dir) / manifest.onnx_file, threads or intra_op_threads(cpus), gpu_ids)
        self.name = name
        self.block_size = manifest.generation.block_size
        self.graph = DecoderGraph(session, manifest.generation)
        self.tokenizer = TextTokenizer.for_model(model_dir, manifest, truncate=False)
        # @serve.batch adds these setters; Ray types it as the bare function.
        batched: Any = self.generate  # type: ignore[misc]
        batched.set_max_batch_size(max_batch_size)
        batched.set_batch_wait_timeout_s(batch_wait_timeout_s)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)  # type: ignore[arg-type]
    async def generate(self, rows: list[tuple[list[int], int, bool]]) -> AsyncGenerator[list[Any], None]:  # type: ignore[misc]
        """Rows of (prompt ids, max tokens, stop at end-of-text); yields each row's next token id,
        or StopIteration once the row is done (the batch decodes until its longest row ends)."""
        ids, mask = pad_left([r[0] for r in rows], self.tokenizer.pad_id)
        pos = np.clip(mask.cumsum(1) - 1, 0, None)
        logits, past = await asyncio.to_thread(self.graph, ids, pos, mask, self.graph.empty_past(len(rows)))
        pos = pos[:, -1:]
        made = [0] * len(rows)
        done = [False] * len(rows)
        while True:
            tokens = logits[:, -1].argmax(axis=-1)
            out: list[Any] = []
            for i, (_, limit, stop_at_eos) in enumerate(rows):
                if done[i]:
                    out.append(StopIteration)
                    continue
                made[i] += 1
                out.append(int(tokens[i]))
                done[i] = made[i] >= limit or (stop_at_eos and int(tokens[i]) == self.tokenizer.eos_id)
            yield out
            if all(done):
                return
            mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
            # A finished row is still fed (the batch decodes to its longest row): keep its position in range.
            pos = np.minimum(pos + 1, self.block_size - 1)
            logits, past = await asyncio.to_thread(self.graph, tokens[:, None].astype(np.int64), pos, mask, past)

    async def __call__(self, request: Request) -> StreamingResponse:
        body = json.loads(await request.body())
        prompt = self.tokenizer.encode(body["prompt"]) or [self.tokenizer.eos_id]
        limit = min(int(body.get("max_tokens", 16)), self.block_size - len(prompt))
        return StreamingResponse(self._events(prompt, limit, not body.get("ignore_eos")), media_type="text/event-stream")

    async def _events(self, prompt: list[int], limit: int, stop_at_eos: bool) -> AsyncIterator[str]:
        made = 0
        async for token in self.generate((prompt, limit, stop_at_eos)):  # type: ignore[misc, call-arg]
            made += 1
            chunk = {"object": "text_completion", "model": self.name,
                     "choices": [{"index": 0, "text": self.tokenizer.decode([token]), "finish_reason": None}],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": made}}  # fmt: skip
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"


def build(args: dict[str, Any]) -> Any:
    batch = int(args.get("max_batch_size", 8))
    return (
        cast(Any, PlainGenerator)
        .options(max_ongoing_requests=max(4 * batch, 32))
        .bind(args["name"], args["model_dir"], batch, float(args.get("batch_wait_timeout_s", 0.01)), args.get("threads"))
    )
