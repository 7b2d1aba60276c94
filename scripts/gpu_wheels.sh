#!/usr/bin/env bash
# Wheels for a GPU machine that has torch but cannot reach PyPI (Python 3.12, x86-64).
#   .gpu/whl: megatron-core 0.19.2 and polars (43 MB)        -- the GPU tests and benches
#   .gpu/ray: Ray without its Java jars and dashboard build, and jsonschema (45 MB)
#             -- only tests/gpu/test_gpu_ray_queue.py
# Ray's full wheel is 79 MB; the two folders together are over 64 MB, so a machine that
# takes at most that per call gets them in two consecutive calls into one --target folder.
# Install there: pip install --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
get() {
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"
}
mkdir -p .gpu/whl .gpu/ray .gpu/tmp
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
get .gpu/whl megatron-core==0.19.2 polars==1.35.2 polars-runtime-32==1.35.2
get .gpu/ray jsonschema jsonschema-specifications referencing rpds-py
get .gpu/tmp "ray==2.60.0"
"$PY" - <<'PY'
import glob, os, zipfile

src = glob.glob(".gpu/tmp/ray-*.whl")[0]
drop = lambda name: name.startswith(("ray/jars/", "ray/dashboard/client/build/"))
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(os.path.join(".gpu/ray", os.path.basename(src)),
                                                  "w", zipfile.ZIP_DEFLATED) as zo:
    for info in zi.infolist():
        if drop(info.filename):
            continue
        data = zi.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            keep = [r for r in data.decode().splitlines() if not drop(r.split(",")[0])]
            data = ("\n".join(keep) + "\n").encode()
        zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
PY
rm -r .gpu/tmp
du -sh .gpu/whl .gpu/ray
