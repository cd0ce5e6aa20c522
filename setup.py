"""pip install --no-build-isolation .

Drives the same CMake build as `make` (one build graph, nothing compiled
twice): CMake writes rotary._C and librotary straight into the wheel's
package directory. --no-build-isolation matters: the extension must be built
against the torch that will import it. ROTARY_BUILD_DIR=<a configured build
tree> packages that tree's libraries instead of configuring a new one.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

# What the README's install steps put in the venv first. With
# --no-build-isolation pip installs none of pyproject.toml's build
# requirements, so a missing one is named here instead of failing later.
# pip runs `dist_info` (metadata) and `bdist_wheel`; both need the
# bdist_wheel command, which is setuptools' own from 70.1 and the wheel
# package's before.
_INSTALL_FIRST = "pip install torch==2.11.0 setuptools wheel"
_WHEEL_COMMANDS = {"bdist_wheel", "dist_info", "editable_wheel"}


def _require_bdist_wheel() -> None:
    if not _WHEEL_COMMANDS.intersection(sys.argv[1:]):
        return
    from setuptools.dist import Distribution

    try:
        Distribution().get_command_class("bdist_wheel")
    except Exception:  # "invalid command" (DistutilsModuleError), or the command fails to import
        sys.exit(
            "rotary: the 'wheel' package is missing from this Python environment "
            f"({sys.prefix}); pip's --no-build-isolation builds with the environment's own "
            f"packaging tools. Run `{_INSTALL_FIRST}` first.")


def _require_torch():
    try:
        import torch
    except ImportError:
        sys.exit(
            f"rotary: torch is not installed in this Python environment ({sys.prefix}); the "
            "extension is built against the torch that will import it (--no-build-isolation). "
            f"Run `{_INSTALL_FIRST}` first.")
    return torch


def _run(cmd: list) -> None:
    try:
        subprocess.check_call(cmd)
    except FileNotFoundError:
        sys.exit(f"rotary: `{cmd[0]}` was not found on PATH; the build needs CMake 3.25 or newer.")


_require_bdist_wheel()


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        torch = _require_torch()

        package_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        prebuilt = os.environ.get("ROTARY_BUILD_DIR")
        if prebuilt:
            # A tree `make build` configured: bring it up to date and package
            # the two libraries it wrote (nothing compiled twice).
            _run(["cmake", "--build", prebuilt, "--target", "rotary_python", "-j", jobs])
            cache = (Path(prebuilt) / "CMakeCache.txt").read_text().splitlines()
            out = Path(next(l.split("=", 1)[1] for l in cache if l.startswith("ROTARY_PYTHON_OUTPUT_DIR:")))
            package_dir.mkdir(parents=True, exist_ok=True)
            for lib in [*out.glob("_C*.so"), *out.glob("librotary.so*")]:
                shutil.copy2(lib, package_dir / lib.name)
            return
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DROTARY_PYTHON_OUTPUT_DIR={package_dir}",
            "-DROTARY_BUILD_TESTS=OFF",
            "-DROTARY_BUILD_BENCHMARKS=OFF",
            "-DROTARY_BUILD_EXAMPLES=OFF",
        ]
        if "ROTARY_CUDA" in os.environ:
            configure.append(f"-DROTARY_CUDA={os.environ['ROTARY_CUDA']}")
        _run(configure)
        _run(["cmake", "--build", str(build_dir), "--target", "rotary_python", "-j", jobs])


setup(
    name="rotary",
    version="0.1.0",
    description="Rotary Position Embedding (RoPE) as LibTorch dispatcher ops: C++, CUDA and Python",
    packages=["rotary", "rotary.integrations"],
    package_data={"rotary.integrations": ["hub_kernel/*"]},
    package_dir={"": "python"},
    ext_modules=[Extension("rotary._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch"],
    zip_safe=False,
)
