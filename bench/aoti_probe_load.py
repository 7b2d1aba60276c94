"""Probe: load one AOTInductor package on CUDA three ways (diagnosing a loader crash).

    python -X faulthandler bench/aoti_probe_load.py PACKAGE.pt2 [python|package|runner]
"""

import glob
import os
import sys
import tempfile
import zipfile

import torch

path, how = sys.argv[1], sys.argv[2]
torch.zeros(1, device="cuda")
print("cuda up", flush=True)
if how == "python":
    torch._inductor.aoti_load_package(path)
elif how == "package":
    torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, 0)
else:
    d = tempfile.mkdtemp()
    zipfile.ZipFile(path).extractall(d)
    for f in sorted(glob.glob(os.path.join(d, "**", "*"), recursive=True))[:40]:
        print(os.path.relpath(f, d), os.path.getsize(f) if os.path.isfile(f) else "", flush=True)
    (so,) = glob.glob(os.path.join(d, "**", "*.so"), recursive=True)
    cubins = os.path.dirname(so)
    print("runner on", so, flush=True)
    r = torch._C._aoti.AOTIModelContainerRunnerCuda(so, 1, "cuda", cubins)
print("loaded", how, flush=True)
