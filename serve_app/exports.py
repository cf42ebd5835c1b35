"""Model directories as their exporters wrote them: what the project needs, read from the files.

A directory that `serve-app models build` made has a manifest.json; an ordinary export has
none, and its manifest is read from what the exporter left: the ONNX graph's inputs and
outputs, Hugging Face's config.json (labels, context length), tokenizer.json with
tokenizer_config.json / special_tokens_map.json (special tokens, maximum length) and
preprocessor_config.json (resize, crop, mean/std). What is missing comes back as one line per
problem, each saying how to fix it, never as a stack trace from the replica.

Recognized: text classifiers exported by optimum (`input_ids`, `attention_mask`, optionally
`token_type_ids`), image classifiers with one (N, 3, H, W) float input whatever its name
(torchvision or timm through `torch.onnx.export`), decoders exported by optimum with past key
values (`past_key_values.{i}.key/value`, `present.{i}.key/value`, `position_ids`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.config import AppArgs, ModelConfig
from serve_app.families import FAMILIES, Family, family, load
from serve_app.manifest import MANIFEST_FILE, Datatype, GenerationSpec, ImageSpec, Manifest, TensorSpec
from serve_app.sources import local_path

TOKENIZER_FILE = "tokenizer.json"
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
PAST_KEY = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
# tokenizer_config.json's model_max_length when the tokenizer sets none (transformers' VERY_LARGE_INTEGER).
UNSET_MAX_LENGTH = 10**20
DEFAULT_TEXT_LENGTH = 512
ORT_TYPES: dict[str, Datatype] = {
    "tensor(float)": "FP32",
    "tensor(float16)": "FP16",
    "tensor(double)": "FP64",
    "tensor(int64)": "INT64",
    "tensor(int32)": "INT32",
    "tensor(uint8)": "UINT8",
    "tensor(bool)": "BOOL",
}


class ExportProblems(ValueError):
    """A model directory the project cannot serve as it is: one line per problem."""

    def __init__(self, source: str | Path, problems: list[str]) -> None:
        self.source = str(source)
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


@dataclass(frozen=True)
class Declared:
    """What a config entry says about a model, which wins over what the files say."""

    name: str
    family: str | None = None
    image: dict[str, Any] | None = None  # mean, std, resize, size (serve_app.config.ImagePreprocessing)

    @classmethod
    def of(cls, name: str, config: ModelConfig) -> Declared:
        image = config.image.model_dump(exclude_none=True) if config.image else None
        return cls(name, None if config.preset else config.family, image)


# (model directory, what the config declares, the graph's inputs, its outputs, config.json) ->
# (the manifest's fields beyond name, family, graph and tensors; one line per problem)
ReadExport = Callable[[Path, Declared, list[TensorSpec], list[TensorSpec], dict[str, Any]], tuple[dict[str, Any], list[str]]]


@dataclass(frozen=True)
class ExportReader:
    """How one family's export is read (a family's `export`, serve_app.families): whether a graph
    is of the family, from its inputs, and the manifest from the exporter's files."""

    expects: str  # the inputs it recognizes, for the message when no family's reader does
    recognizes: Callable[[list[TensorSpec]], bool]
    read: ReadExport


def locate(path: str | Path) -> tuple[Path, str | None]:
    """The model directory and, when `path` names the graph itself, its file name."""
    p = Path(path)
    if p.suffix == ".onnx" or p.is_file():
        return p.parent, p.name
    return p, None


def discover(path: str | Path, declared: Declared) -> tuple[Path, Manifest]:
    """The model directory and its manifest: the manifest file when there is one, else read from
    the export. Raises ExportProblems with every problem found."""
    model_dir, graph = locate(path)
    if not model_dir.is_dir():
        raise ExportProblems(path, [f"no such directory {model_dir}: build it (`serve-app models build`) or fix `path`"])
    if graph is None and (model_dir / MANIFEST_FILE).is_file():
        manifest = Manifest.load(model_dir)
        problems = _files_present(model_dir, manifest)
        if problems:
            raise ExportProblems(model_dir, problems)
        return model_dir, manifest
    return model_dir, read_export(model_dir, declared, graph)


def _files_present(model_dir: Path, manifest: Manifest) -> list[str]:
    problems = []
    if not (model_dir / manifest.onnx_file).is_file():
        problems.append(f"{manifest.onnx_file} is missing: rebuild the model (`serve-app models build`)")
    if manifest.tokenizer_file and not (model_dir / manifest.tokenizer_file).is_file():
        problems.append(f"{manifest.tokenizer_file} is missing: rebuild the model (`serve-app models build`)")
    return problems


def graph_file(model_dir: Path, graph: str | None) -> tuple[str | None, list[str]]:
    if graph is not None:
        return graph, [] if (model_dir / graph).is_file() else [f"no graph {graph} in {model_dir}"]
    if (model_dir / "model.onnx").is_file():
        return "model.onnx", []
    found = sorted(p.name for p in model_dir.glob("*.onnx"))
    if len(found) == 1:
        return found[0], []
    if not found:
        return None, [f"no .onnx file in {model_dir}: export the model to ONNX (optimum-cli export onnx, torch.onnx.export)"]
    return None, [f"several graphs in {model_dir} ({', '.join(found)}): set `path` to the one to serve"]


def graph_signature(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph's inputs and outputs as ONNX Runtime reads them (no optimization: only the signature)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])

    def spec(arg: Any) -> TensorSpec:
        datatype = ORT_TYPES.get(arg.type)
        if datatype is None:
            raise ValueError(f"{arg.name} has type {arg.type}, which this project does not serve")
        return TensorSpec(name=arg.name, datatype=datatype, shape=[d if isinstance(d, int) and d > 0 else -1 for d in arg.shape])

    return [spec(a) for a in session.get_inputs()], [spec(a) for a in session.get_outputs()]


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ExportProblems(path.parent, [f"{path.name} is not valid JSON ({e}): re-export the model"]) from None
    return data if isinstance(data, dict) else {}


def read_export(model_dir: Path, declared: Declared, graph: str | None = None) -> Manifest:
    """The manifest of an export without one; ExportProblems lists everything in the way."""
    onnx_file, problems = graph_file(model_dir, graph)
    if onnx_file is None:
        raise ExportProblems(model_dir, problems)
    try:
        inputs, outputs = graph_signature(model_dir / onnx_file)
    except Exception as e:  # a truncated or foreign file: ORT's message, first line only
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ExportProblems(model_dir, [f"{onnx_file} cannot be loaded by ONNX Runtime ({first}): re-export it"]) from None
    names = [t.name for t in inputs]
    # The families that read exports (serve_app.families); at most one recognizes a graph.
    readers = {f.name: r for f in FAMILIES.values() if (r := reader_of(f)) is not None}
    family = next((name for name, reader in readers.items() if reader.recognizes(inputs)), None)
    if declared.family is not None and family is not None and declared.family != family:
        problem = f"the graph looks like a {family} model (inputs {names}) but the config says family {declared.family}"
        raise ExportProblems(model_dir, [problem])
    family = declared.family or family
    if family is None:
        raise ExportProblems(model_dir, [f"cannot tell what the graph is from its inputs {names}: " + _expected(readers)])
    if (reader := readers.get(family)) is None:
        raise ExportProblems(model_dir, [f"the {family} family reads no export: give {model_dir} a {MANIFEST_FILE}"])
    config = _json(model_dir / "config.json")
    base = {"name": declared.name, "family": family, "onnx_file": onnx_file, "inputs": inputs, "outputs": outputs}
    source = {"imported_from": str(model_dir), "model_type": config.get("model_type")}
    fields, more = reader.read(model_dir, declared, inputs, outputs, config)
    problems += more
    if problems:
        raise ExportProblems(model_dir, problems)
    return Manifest.model_validate({**base, **fields, "source": source})


def _expected(readers: dict[str, ExportReader]) -> str:
    said = [r.expects for r in readers.values()]
    return "expected " + ", ".join([*said[:-1], f"or {said[-1]}"] if len(said) > 1 else said)


def _is_decoder(inputs: list[TensorSpec]) -> bool:
    return any(PAST_KEY.match(t.name) for t in inputs)


def _is_text_classifier(inputs: list[TensorSpec]) -> bool:
    return any(t.name == "input_ids" for t in inputs) and not _is_decoder(inputs)


def _is_image_classifier(inputs: list[TensorSpec]) -> bool:
    return len(inputs) == 1 and len(inputs[0].shape) == 4 and inputs[0].datatype in ("FP32", "FP16")


def _labels(config: dict[str, Any], classes: int | None) -> tuple[list[str], list[str]]:
    names = config.get("label_names")  # timm's
    if isinstance(names, list) and names and (classes is None or len(names) == classes):
        return [str(n) for n in names], []
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            ordered = sorted((int(k), str(v)) for k, v in id2label.items())
        except ValueError:
            return [], ["config.json's id2label has keys that are not class indices"]
        labels = [v for _, v in ordered]
        if classes is not None and len(labels) != classes:
            return [], [f"config.json's id2label names {len(labels)} classes but the graph gives {classes}"]
        return labels, []
    if classes is None:
        return [], ["the graph's output has no fixed number of classes and config.json has no id2label: add one"]
    return [f"LABEL_{i}" for i in range(classes)], []


def _classes(outputs: list[TensorSpec]) -> tuple[int | None, list[str]]:
    if not outputs or len(outputs[0].shape) != 2:
        shape = outputs[0].shape if outputs else None
        return None, [f"a classifier's first output must be (batch, classes) logits, the graph gives {shape}"]
    n = outputs[0].shape[1]
    return (n if n > 0 else None), []


# -- text --------------------------------------------------------------------------------------


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json write it: a string or
    an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(model_dir: Path, config: dict[str, Any]) -> tuple[str | None, str | None, int | None]:
    """(pad, eos, model_max_length) from the tokenizer's own config files, then config.json's ids."""
    from tokenizers import Tokenizer

    tok_cfg = _json(model_dir / "tokenizer_config.json")
    special = _json(model_dir / "special_tokens_map.json")
    pad = _token(tok_cfg.get("pad_token")) or _token(special.get("pad_token"))
    eos = _token(tok_cfg.get("eos_token")) or _token(special.get("eos_token"))
    if pad is None or eos is None:
        tok = Tokenizer.from_file(str(model_dir / TOKENIZER_FILE))
        if pad is None and isinstance(config.get("pad_token_id"), int):
            pad = tok.id_to_token(config["pad_token_id"])
        if eos is None and isinstance(config.get("eos_token_id"), int):
            eos = tok.id_to_token(config["eos_token_id"])
    max_length = tok_cfg.get("model_max_length")
    return pad, eos, max_length if isinstance(max_length, int) and 0 < max_length < UNSET_MAX_LENGTH else None


def _tokenizer(model_dir: Path, config: dict[str, Any]) -> tuple[dict[str, Any], int | None, list[str]]:
    """The manifest's tokenizer fields (its file, pad and end-of-sequence tokens) and the context
    length, or the problems in the way."""
    if not (model_dir / TOKENIZER_FILE).is_file():
        missing = (
            f"no {TOKENIZER_FILE} in {model_dir}: save the model's fast tokenizer beside the graph "
            "(`AutoTokenizer.from_pretrained(...).save_pretrained(DIR)`; optimum's export copies it)"
        )
        return {}, None, [missing]
    try:
        pad, eos, max_length = special_tokens(model_dir, config)
    except Exception as e:
        return {}, None, [f"{TOKENIZER_FILE} cannot be read by the tokenizers library ({str(e)[:160]}): save it again"]
    positions = config.get("max_position_embeddings") or config.get("n_positions")
    limits = [n for n in (max_length, positions) if isinstance(n, int) and n > 0]
    length = min(limits) if limits else None
    return {"tokenizer_file": TOKENIZER_FILE, "pad_token": pad, "eos_token": eos}, length, []


def _read_text_classifier(
    model_dir: Path, declared: Declared, inputs: list[TensorSpec], outputs: list[TensorSpec], config: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    fields, length, problems = _tokenizer(model_dir, config)
    if problems:
        return {}, problems
    more, problems = _classifier(inputs, outputs, config, fields["pad_token"], length)
    return {**fields, **more}, problems


def _read_decoder(
    model_dir: Path, declared: Declared, inputs: list[TensorSpec], outputs: list[TensorSpec], config: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    fields, length, problems = _tokenizer(model_dir, config)
    if problems:
        return {}, problems
    more, problems = _decoder(inputs, outputs, config, fields["pad_token"], fields["eos_token"], length)
    return {**fields, **more}, problems


def _classifier(
    inputs: list[TensorSpec], outputs: list[TensorSpec], config: dict[str, Any], pad: str | None, length: int | None
) -> tuple[dict[str, Any], list[str]]:
    problems: list[str] = []
    names = [t.name for t in inputs]
    if [n for n in names if n not in TEXT_INPUTS] or "attention_mask" not in names:
        problems.append(f"a text classifier's graph takes input_ids, attention_mask, optionally token_type_ids; not {names}")
    if pad is None:
        problems.append("the tokenizer names no pad token: set pad_token in tokenizer_config.json")
    classes, more = _classes(outputs)
    labels, more2 = _labels(config, classes) if not more else ([], [])
    return {"labels": labels, "max_sequence_length": length or DEFAULT_TEXT_LENGTH}, problems + more + more2


def _decoder(
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    config: dict[str, Any],
    pad: str | None,
    eos: str | None,
    length: int | None,
) -> tuple[dict[str, Any], list[str]]:
    problems: list[str] = []
    names = [t.name for t in inputs]
    layers = sorted({int(m.group(1)) for n in names if (m := PAST_KEY.match(n))})
    if layers != list(range(len(layers))):
        problems.append(f"past_key_values inputs are not numbered 0..n-1: {layers}")
    for needed in ("input_ids", "attention_mask", "position_ids"):
        if needed not in names:
            problems.append(
                f"the decoder's graph has no {needed} input: export it with optimum's text-generation-with-past task, "
                "which takes explicit positions (continuous batching needs them)"
            )
    out_names = {t.name for t in outputs}
    missing = [f"present.{i}.{kind}" for i in layers for kind in ("key", "value") if f"present.{i}.{kind}" not in out_names]
    if missing or "logits" not in out_names:
        problems.append(f"the decoder's graph must output logits and present.{{i}}.key/value; missing {missing or ['logits']}")
    if eos is None:
        problems.append("the tokenizer names no end-of-sequence token: set eos_token in tokenizer_config.json")
    if length is None:
        problems.append(
            "no context length: config.json has no max_position_embeddings or n_positions, "
            "tokenizer_config.json no model_max_length"
        )
    key = next((t for t in inputs if t.name == "past_key_values.0.key"), None)
    if key is None or len(key.shape) != 4:
        problems.append("past_key_values.0.key must be (batch, heads, past, head_dim)")
    if problems:
        return {}, problems
    assert key is not None and length is not None
    heads, head_dim = _kv_heads(key, config)
    if heads is None or head_dim is None:
        return {}, ["the graph's past has no fixed head count or size and config.json does not give them"]
    kv_dtype = "float16" if key.datatype == "FP16" else "float32"
    generation = GenerationSpec(n_layers=len(layers), n_heads=heads, head_dim=head_dim, block_size=length, kv_dtype=kv_dtype)
    return {"max_sequence_length": length, "generation": generation, "pad_token": pad or eos}, []


def _kv_heads(key: TensorSpec, config: dict[str, Any]) -> tuple[int | None, int | None]:
    """Key/value heads and head size: the past's fixed dimensions, else the model's config."""
    if key.shape[1] > 0 and key.shape[3] > 0:
        return key.shape[1], key.shape[3]
    total_heads = config.get("num_attention_heads") or config.get("n_head")
    heads = config.get("num_key_value_heads") or total_heads
    hidden = config.get("hidden_size") or config.get("n_embd")
    head_dim = config.get("head_dim") or (hidden // total_heads if hidden and total_heads else None)
    return (heads if isinstance(heads, int) else None), (head_dim if isinstance(head_dim, int) else None)


# -- images ------------------------------------------------------------------------------------


def _edge(value: Any, *keys: str) -> int | None:
    """A size as preprocessor_config.json writes it: an int, or a dict of edges."""
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        for key in keys:
            if isinstance(value.get(key), int):
                return int(value[key])
    return None


def _image(
    model_dir: Path, declared: Declared, inputs: list[TensorSpec], outputs: list[TensorSpec], config: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    problems: list[str] = []
    given = declared.image or {}
    pre = _json(model_dir / "preprocessor_config.json")
    shape = inputs[0].shape
    if len(shape) != 4 or shape[1] not in (3, -1):
        return {}, [f"an image classifier's input must be (batch, 3, height, width); {inputs[0].name} is {shape}"]
    size = given.get("size") or (shape[2] if shape[2] > 0 and shape[2] == shape[3] else None)
    size = size or _edge(pre.get("crop_size"), "height", "shortest_edge") or _edge(pre.get("size"), "height", "shortest_edge")
    if size is None:
        problems.append("the graph's input has no fixed size: set `image: {size: N}` in the model's config")
    resize = given.get("resize")
    if resize is None and pre.get("do_center_crop", False):
        resize = _edge(pre.get("size"), "shortest_edge", "height")
    mean, std = given.get("mean"), given.get("std")
    timm = config.get("pretrained_cfg")  # a timm model saved with its config (push_to_hub, save_pretrained)
    if mean is None and std is None and isinstance(timm, dict) and timm.get("mean") and timm.get("std"):
        mean, std = timm["mean"], timm["std"]
        crop = timm.get("crop_pct")
        if resize is None and size and isinstance(crop, (int, float)) and 0 < crop < 1:
            resize = round(size / crop)
    if mean is None and std is None and pre:
        if pre.get("do_normalize", True):
            mean, std = pre.get("image_mean"), pre.get("image_std")
        else:
            mean, std = [0.0] * 3, [1.0] * 3
    if mean is None or std is None:
        problems.append(
            "no normalization declared: set `image: {mean: [...], std: [...]}` in the model's config "
            "(torchvision's ImageNet weights: mean [0.485, 0.456, 0.406], std [0.229, 0.224, 0.225]; "
            "mean [0, 0, 0], std [1, 1, 1] when the graph normalizes) or add a preprocessor_config.json"
        )
    classes, more = _classes(outputs)
    labels, more2 = _labels(config, classes) if not more else ([], [])
    problems += more + more2
    if problems:
        return {}, problems
    spec = ImageSpec(mean=mean, std=std, resize=resize if resize and resize != size else None)  # type: ignore[arg-type]
    return {"image_size": size, "image": spec, "labels": labels, "pad_token": None, "eos_token": None}, problems


# The built-in families' readers (serve_app.families.BUILT_IN names them).
TEXT_CLASSIFIER = ExportReader("input_ids and attention_mask (text classifier)", _is_text_classifier, _read_text_classifier)
DECODER = ExportReader(
    "past_key_values.{i}.key/value with position_ids (decoder, optimum's text-generation-with-past)", _is_decoder, _read_decoder
)
IMAGE_CLASSIFIER = ExportReader("one (N, 3, H, W) float input (image classifier)", _is_image_classifier, _image)


def load_problem(args: AppArgs, deployment: str) -> str | None:
    """Why a deployment's model cannot load, in one line, or None when its files are in order:
    the checks a replica's start would fail, made once here, where a failure costs no restarts."""
    return export_problem(args.model_source(deployment), deployment, args.deployment_config(deployment))


def export_problem(source: str, deployment: str, config: ModelConfig) -> str | None:
    """load_problem for a model read from `source` with `config` (a pool's model before it is added)."""
    try:
        model_dir, manifest = discover(local_path(source), Declared.of(deployment, config))
        graph = manifest.onnx_file_for(config.precision)  # the variant the config asks for, built beside FP32
    except ExportProblems as e:
        return "; ".join(e.problems)
    except OSError as e:  # an unreadable directory, an object store that refused, a variant never built
        return str(e)
    if not (model_dir / graph).is_file():
        return f"{graph} is missing from {model_dir}: run `serve-app models build` for this config"
    return None


@functools.cache
def reader_of(f: Family) -> ExportReader | None:
    """How an export of the family is read; None when its model directories carry a manifest."""
    if f.export is None:
        return None
    reader = load(f.export)
    assert isinstance(reader, ExportReader), f"{f.export} is not an ExportReader"
    return reader


def describe(m: Manifest) -> str:
    """One line on a model for `serve-app models import`, in its family's words."""
    f = family(m.family)
    return load(f.describe)(m) if f.describe else f"inputs {m.input_names}, {len(m.labels)} labels"


def describe_text_classifier(m: Manifest) -> str:
    return f"text classifier: {len(m.labels)} labels {m.labels[:4]}, up to {m.max_sequence_length} tokens"


def describe_decoder(m: Manifest) -> str:
    assert m.generation is not None
    g = m.generation
    what = f"decoder: {g.n_layers} layers, {g.n_heads} key/value heads of {g.head_dim}, context {g.block_size}"
    return what + f", end {m.eos_token!r}"


def describe_image_classifier(m: Manifest) -> str:
    norm = f"mean {m.image.mean} std {m.image.std}" if m.image.normalizes else "no normalization"
    return f"image classifier: input {m.inputs[0].name!r} {m.image_size}x{m.image_size}, {len(m.labels)} labels, {norm}"
