"""The libraries a probe with `--dataset` (and every DPO probe) imports that the GPU machine's image lacks,
packed for it: TRL (its packing, collators and DPOTrainer) and `datasets` with what `datasets` needs
(pyarrow, pandas, dill, multiprocess, xxhash, fsspec), at the versions this checkout's environment runs.

pyarrow's wheel is mostly libraries a probe never loads (Flight, S3, the C++ headers, its tests; each checked
with readelf: nothing datasets imports needs them) and pandas' wheel holds its own tests: without them the
tarball, its libraries' symbols stripped and packed with xz, is about 27 MiB: it travels beside
`.gpu-site.tgz` (24 MiB) and Unsloth's 6 MiB within the 64 MiB a call carries.

    python bench/data_site.py                 # here: writes .whl/data-site.txz
    python bench/data_site.py --check         # the same for this machine's Python, imported from the folder:
                                              # the trimmed pyarrow still reads, packs and collates
    # on the GPU machine, .whl/ carried: source bench/gpu_env.sh && python3 bench/...

The folder's path must hold "site-packages": `datasets` fingerprints each `map` function by pickling it with
dill, and dill pickles a module by reference only when its file is under the interpreter's prefix or a
site-packages path; from /tmp/.data-site it tries to pickle pyarrow by value and fails ("Can't pickle
<class 'MonthDayNano'>"), as `--check` did here before its folder was renamed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

from common import pack_site

PACKAGES = ("trl", "datasets", "pyarrow", "pandas", "dill", "multiprocess", "xxhash", "fsspec")
DROP = ("pyarrow/*flight*", "pyarrow/*s3*", "pyarrow/include", "pyarrow/src", "pyarrow/tests", "pyarrow/*.pyx",
        "pyarrow/*.pxd", "pyarrow/libarrow_python.so", "pyarrow/libarrow_python.so.*.*", "pandas/tests")
"""Never loaded by a probe: Flight and S3 (their extension modules are imported inside try blocks by
pyarrow.fs), the headers, Cython sources, tests, and libarrow_python's two extra copies (the extension
modules link libarrow_python.so.N)."""
CHECK = """
from autofit.data.library import collate, packed_bins
bins = packed_bins([5, 3, 9, 2, 7], 10)
assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4], bins
batch = collate([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}], 0, padding_free=True)
assert batch["input_ids"].shape == (1, 5), batch
import pyarrow, datasets, trl
print("data-site ok:", pyarrow.__file__)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="pack for this machine's Python and import from it")
    a = p.parse_args()
    wheels = [f"{name}=={version(name)}" for name in PACKAGES]
    if not a.check:
        pack_site("data-site", wheels, DROP, small=True)
        return
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = pack_site("data-site-check", wheels, DROP, python=here, small=True)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(out) as tar:  # what `python3 -m tarfile -e` does
            tar.extractall(Path(tmp, "site-packages"), filter="data")
        site = Path(tmp, "site-packages", ".data-site-check")
        env = {"PYTHONPATH": f"{site}:{Path(__file__).resolve().parent.parent}", "PATH": "/usr/bin:/bin"}
        proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True)
    out.unlink()
    print(proc.stdout + proc.stderr, end="")
    if proc.returncode or str(site) not in proc.stdout:
        sys.exit("data_site: the trimmed folder did not import (above)")


if __name__ == "__main__":
    main()
