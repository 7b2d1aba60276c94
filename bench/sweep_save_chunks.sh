#!/bin/bash
# The save writer's chunk size and depth against step time: bench_save_gpu.py --save-every 1
# in host memory, once per CHUNK_MIBxDEPTH, each on a copy of this tree with tensorfile's two
# constants set (the tree itself is not touched). Results: $OUT (or bench/results)/save_chunks_*.json
#   bash bench/sweep_save_chunks.sh 16x4 32x2 32x3 64x2     # H200, ~90 s each
#   SWEEP_ARGS="--smoke --device cpu" OUT=/tmp bash bench/sweep_save_chunks.sh 8x2   # logic check
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/bench/results}
copy=
trap 'rm -rf "${copy:-}"' EXIT  # a failed run leaves no copy of the tree behind
for cfg in "$@"; do
  mib=${cfg%x*}; depth=${cfg#*x}
  copy=$(mktemp -d)
  (cd "$root" && tar cf - --exclude=.venv --exclude=.gpu --exclude=.git treeflow bench) | tar xf - -C "$copy"
  sed -i "s/^CHUNK_BYTES = .*/CHUNK_BYTES = $mib << 20/; s/^DEPTH = [0-9]*/DEPTH = $depth/" \
    "$copy/treeflow/tensorfile.py"
  grep -q "^CHUNK_BYTES = $mib << 20" "$copy/treeflow/tensorfile.py"
  grep -q "^DEPTH = $depth" "$copy/treeflow/tensorfile.py"
  echo "== $mib MiB x $depth"
  OUT=$copy python3 "$copy/bench/bench_save_gpu.py" --save-every 1 --work /dev/shm --steps 6 ${SWEEP_ARGS:-} \
    2>&1 | grep -v "^treeflow:" | tail -4
  mv "$copy"/bench_save_*.json "$out/save_chunks_${mib}x${depth}.json"
  rm -rf "$copy" /dev/shm/treeflow-save-*
  copy=
done
