"""The SASS of a Mosaic GPU kernel dumped as PTX, where the GPU machine's pip CUDA has no nvdisasm
(MOSAIC_GPU_DUMP_SASS then fails): assemble the PTX with the system toolkit's ptxas for sm_90a and
disassemble the cubin with its cuobjdump. Used by mgpu_dump.py and check_tail.py."""

from __future__ import annotations

import shutil
import subprocess


def tool(name: str) -> str:
    """A CUDA tool from PATH, else the system toolkit's."""
    return shutil.which(name) or f"/usr/local/cuda/bin/{name}"


def sass_of_ptx(ptx: str) -> tuple[str, str]:
    """Write <ptx stem>.sass next to the PTX file; return (its path, ptxas' report)."""
    stem = ptx[:-4] if ptx.endswith(".ptx") else ptx
    cubin = stem + ".cubin"
    r = subprocess.run([tool("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True)
    report = r.stderr.strip()
    r = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True)
    with open(stem + ".sass", "w") as fh:
        fh.write(r.stdout or r.stderr)
    return stem + ".sass", report
