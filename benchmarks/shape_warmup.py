"""What a new input shape costs ONNX Runtime's CUDA provider, by cuDNN search mode.

    python -m benchmarks.shape_warmup models-realsize/resnet-heavy/model.onnx

For each batch size, the first run (a shape the session has not seen) and the second.
Why GPU image replicas pad batches to a few sizes warmed at start (serve_app.padding).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import onnxruntime as ort

from benchmarks import probe_args

SIZES = (2, 3, 5, 8, 13, 21, 32)


def main(argv: list[str]) -> int:
    path = probe_args.parse(argv, __doc__, "python -m benchmarks.shape_warmup", "MODEL_ONNX").MODEL_ONNX
    for algo in ("EXHAUSTIVE", "HEURISTIC"):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        cuda = ("CUDAExecutionProvider", {"cudnn_conv_algo_search": algo})
        s = ort.InferenceSession(path, opts, providers=[cuda, "CPUExecutionProvider"])
        s.run(None, {"image": np.zeros((1, 3, 224, 224), np.float32)})
        first: list[float] = []
        second: list[float] = []
        for n in SIZES:
            feed = {"image": np.random.rand(n, 3, 224, 224).astype(np.float32)}
            for runs in (first, second):
                t0 = time.perf_counter()
                s.run(None, feed)
                runs.append(round((time.perf_counter() - t0) * 1e3, 1))
        print(algo, f"batch sizes {SIZES}: first run ms {first}, second run ms {second}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
