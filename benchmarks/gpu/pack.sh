#!/usr/bin/env bash
# Here (no GPU, network to PyPI): the Python 3.12 packages a lent GPU machine lacks, packed into
# five pieces that each fit one device call beside the working tree (64 MiB a call).
# The machine's image has PyTorch, numpy, onnx, aiohttp, grpcio, pillow, ... but not Ray, Serve's
# web stack or onnxruntime-gpu. Then carry each piece in turn (`.whl/site.tar.xz.partN`, one call
# each, back to back so the machine stays warm) and run remote.sh there. See README.md here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
rm -rf /tmp/whl /tmp/site312 && mkdir -p /tmp/whl .whl
python3 -m pip download -q "${plat[@]}" -d /tmp/whl "ray[serve]==2.60.0" onnxruntime-gpu==1.31.1 "redis>=5" \
  "tritonclient[grpc]>=2.50" "msgspec>=0.18" "opentelemetry-sdk==1.45.*" "opentelemetry-exporter-otlp-proto-http==1.45.*" py-spy
# What the image already has (a second copy of numpy or grpc's runtime would shadow its own).
have='^(aiohappyeyeballs|aiohttp-|aiosignal|attrs|certifi|charset_normalizer|click|filelock|flatbuffers|frozenlist|h11|idna|jinja2|markupsafe|ml_dtypes|msgpack|multidict|numpy|packaging|prometheus_client|propcache|psutil|pyyaml|requests|six|typing_extensions|urllib3|uvloop|wrapt|yarl|anyio|annotated_doc)'
(cd /tmp/whl && ls ./*.whl | sed 's|^\./||' | grep -v -E "$have") > /tmp/whl/list.txt
(cd /tmp/whl && python3 -m pip install -q --no-deps --no-compile --target /tmp/site312 "${plat[@]}" --platform any $(cat list.txt))
# Not needed to serve or benchmark: TensorRT's provider, ORT's C library and Python tools, Ray's
# Java jars and RLlib, source maps, crypto and virtualenv (runtime environments are not used).
cd /tmp/site312
rm -rf onnxruntime/capi/libonnxruntime_providers_tensorrt.so onnxruntime/capi/libonnxruntime.so.* onnxruntime/transformers \
  onnxruntime/quantization onnxruntime/tools onnxruntime/datasets ray/jars ray/rllib cryptography* cffi* _cffi_backend* virtualenv*
find . -name "*.js.map" -delete
find . -name __pycache__ -type d -prune -exec rm -rf {} +
cd /tmp && tar -cf - site312 | xz -9 -T2 > /tmp/site.tar.xz
rm -f "$OLDPWD/.whl"/site.tar.xz.part* && split -n 5 -d -a 1 /tmp/site.tar.xz /tmp/site.tar.xz.part
ls -la /tmp/site.tar.xz.part*
