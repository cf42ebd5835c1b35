#!/usr/bin/env bash
# Runs on the lent GPU machine (through the device tool), in the repository root, after
# pack.sh's pieces were carried over one call each (`.whl/site.tar.xz.partN`, moved to
# /tmp/parts by each call). Unpacks Ray, Serve and onnxruntime-gpu for the machine's
# Python 3.12, builds the benchmark models there and runs `bench compare` on the GPU config.
# Usage: bash benchmarks/gpu/remote.sh prepare   (unpack, check, build the models, start and stop Ray)
#        bash benchmarks/gpu/remote.sh probe   (lane_probe.py: ResNet-50 with and without the urgent lane)
#        bash benchmarks/gpu/remote.sh session   (session_probe.py: one ResNet-50 session outside Serve)
#        bash benchmarks/gpu/remote.sh compare [compare args...]   (results under $OUT/compare)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/parts "$OUT" && mv .whl/*.part* /tmp/parts/ 2>/dev/null
step() { echo "== $(date +%T) $*"; }
if [ ! -d /tmp/site312 ]; then
  step unpack; ls -la /tmp/parts
  if command -v xz >/dev/null; then cat /tmp/parts/site.tar.xz.part* | xz -dc | tar -C /tmp -xf - || exit 1
  else cat /tmp/parts/site.tar.xz.part* | python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" | tar -C /tmp -xf - || exit 1
  fi
  sed -i "1s|.*|#!/usr/bin/env python3|" /tmp/site312/bin/*
fi
# Wheels carried beside the pieces (a package the pieces lack): installed into the same place.
# (Into a folder of their own, copied over: `pip install --target` replaces the target's bin/, Ray's CLI.)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/extra .whl/*.whl && cp -r /tmp/extra/. /tmp/site312/ || exit 1
fi
export PYTHONPATH=/tmp/site312:$PWD PATH=/tmp/site312/bin:$PATH PYTHONUNBUFFERED=1
nv=$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])")
LD_LIBRARY_PATH=$(find "$nv" -name 'lib*.so*' -printf '%h\n' | sort -u | paste -sd:):${LD_LIBRARY_PATH:-}
export LD_LIBRARY_PATH
step check
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import onnxruntime as o, ray, fastapi; print('ort', o.__version__, o.get_available_providers(), 'ray', ray.__version__)" || exit 1
if [ ! -f models-realsize/resnet-heavy/model.onnx ]; then
  step build; python3 -m serve_app.tools.cli models build --config configs/bench-gpu.yaml > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  du -sh models-realsize/*
fi
mode=${1:-prepare}; shift || true
if [ "$mode" = prepare ]; then
  step ray
  python3 -c "
from benchmarks.cluster import RayCluster, stop_ray
from benchmarks.scenarios import DEFAULT_INGRESS
import tempfile, pathlib, ray
with RayCluster(DEFAULT_INGRESS, pathlib.Path(tempfile.mkdtemp()), pathlib.Path('models-realsize')):
    ray.init(address='auto'); print(ray.cluster_resources()); ray.shutdown()
" 2>&1 | tail -5
elif [ "$mode" = session ]; then
  step session; python3 benchmarks/gpu/session_probe.py models-realsize/resnet-heavy 2>&1 | grep -v "^\s*$" | tail -30
elif [ "$mode" = probe ]; then
  step probe; python3 benchmarks/gpu/lane_probe.py "$OUT/probe" 2>&1 | grep -v "^\s*$" | tail -60
else
  step compare
  python3 -m benchmarks compare --config configs/bench-gpu.yaml --out "$OUT/compare" "$@" 2>&1 | grep -v "^\s*$" | tail -80
fi
step done
