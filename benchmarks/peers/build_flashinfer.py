"""Builds the FlashInfer benchmark peer here, for the GPU machine to load.

The GPU machine has no network and the flashinfer-python wheel (about 100 MB,
with a dozen dependencies) is over the device carry limit, so this machine
downloads the pinned wheel, unpacks only its CUDA headers, and compiles
flashinfer_peer.cu (two torch ops over FlashInfer's header-only pos_enc.cuh)
for sm_90 with nvcc; no GPU is needed. The result, .peers/lib/
rotary_flashinfer_peer.so (a few MB), goes in the run's carry; the benchmarks
load it with torch.ops.load_library when it is there (bench_common.flashinfer_ops).

    .venv/bin/python benchmarks/peers/build_flashinfer.py [--arch 9.0] [--version 0.7.4]
"""

import argparse
import os
import shutil
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PEERS = os.path.join(ROOT, ".peers")
LIB = os.path.join(PEERS, "lib", "rotary_flashinfer_peer.so")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.7.4", help="flashinfer-python release")
    ap.add_argument("--arch", default="9.0", help="TORCH_CUDA_ARCH_LIST for the build (the H200: 9.0)")
    a = ap.parse_args()

    wheels = os.path.join(PEERS, "wheel")
    wheel = os.path.join(wheels, f"flashinfer_python-{a.version}-py3-none-any.whl")
    if not os.path.exists(wheel):
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                               f"flashinfer-python=={a.version}", "-d", wheels])
    # Its headers, and the CCCL it ships (newer than the toolkit's: cuda/cmath's fast_mod_div).
    data = os.path.join(PEERS, f"flashinfer-{a.version}")
    if not os.path.isdir(data):
        prefix = "flashinfer/data/"
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith((prefix + "include/flashinfer/", prefix + "cccl/")) and not name.endswith("/"):
                    dest = os.path.join(data, name[len(prefix):])
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    with z.open(name) as src, open(dest, "wb") as out:
                        shutil.copyfileobj(src, out)
    includes = [os.path.join(data, d) for d in ("include", "cccl/libcudacxx/include", "cccl/cub", "cccl/thrust")]

    os.environ["TORCH_CUDA_ARCH_LIST"] = a.arch
    from torch.utils.cpp_extension import load  # after the arch list is set

    build = os.path.join(PEERS, "build")
    os.makedirs(build, exist_ok=True)
    path = load(name="rotary_flashinfer_peer", sources=[os.path.join(HERE, "flashinfer_peer.cu")],
                extra_include_paths=includes, build_directory=build, is_python_module=False,
                # FlashInfer's vector types need the half / bfloat16 operators torch's flags turn off.
                extra_cuda_cflags=["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__",
                                   "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                                   "-U__CUDA_NO_HALF2_OPERATORS__"], verbose=False)
    os.makedirs(os.path.dirname(LIB), exist_ok=True)
    shutil.copy(path if isinstance(path, str) else os.path.join(build, "rotary_flashinfer_peer.so"), LIB)
    print(f"built {os.path.relpath(LIB, ROOT)} ({os.path.getsize(LIB) // 1024} KB) from flashinfer-python "
          f"{a.version} for arch {a.arch}; carry .peers/lib")


if __name__ == "__main__":
    main()
