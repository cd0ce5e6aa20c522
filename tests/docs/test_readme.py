"""Runs every fenced code block of README.md and docs/*.md.

Each block must run on its own: whatever it uses, it defines or imports.
- ```python blocks are executed, each in a fresh, empty namespace. A block
  that mentions CUDA skips without a GPU.
- ```cpp blocks are wrapped, each in its own function, into ONE generated
  translation unit that is compiled once (a CMake project that does
  find_package(Torch) and links the librotary next to ``rotary.__file__``)
  and then run once per block. The wrapper declares nothing the block could
  use: a block is a function body that includes its headers (#include lines
  are hoisted to the top) and defines its own inputs; a block with its own
  ``int main`` is kept whole and called. #line directives make compiler
  errors point at the document.
  The build lives in .pytest_cache, so reruns are incremental.
- Anything else (sh, cmake, plain ``` trees and schemas) is reported as
  skipped, by language. So is a block whose fence is preceded by the line
  ``<!-- doctest: skip -->`` (blank lines between are allowed).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = {"python", "py", "python3"}
CPP = {"cpp", "c++", "cxx"}
SKIP_EXIT = 77  # a cpp snippet that needs CUDA, run without a GPU


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the first code line in its document
    code: str
    skip_marked: bool = False  # preceded by <!-- doctest: skip -->
    doc: Path = README

    @property
    def name(self) -> str:
        return self.doc.relative_to(ROOT).as_posix()

    @property
    def id(self) -> str:
        return f"{self.name}:L{self.line}-{self.lang or 'plain'}"


_OPEN = re.compile(r"^( *)(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")
_SKIP_MARK = "<!-- doctest: skip -->"


def extract_blocks(text: str, doc: Path = README) -> list[Block]:
    """Fenced blocks (``` or ~~~, any indentation) in document order."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        close = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body, j = [], i + 1
        while j < len(lines) and not close.match(lines[j]):
            line = lines[j]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
            j += 1
        before = [line.strip() for line in lines[:i] if line.strip()]
        marked = bool(before) and before[-1] == _SKIP_MARK
        blocks.append(Block(lang, i + 2, "\n".join(body) + "\n", marked, doc))
        i = j + 1
    return blocks


BLOCKS = [b for doc in DOCS for b in extract_blocks(doc.read_text(), doc)]


def _needs_cuda(code: str) -> bool:
    return "cuda" in code.lower()


def python_namespace() -> dict:
    """A fresh namespace: a block imports and defines everything it uses."""
    return {"__name__": "__doc_block__"}


# ---------------------------------------------------------------------------
# C++: one generated translation unit for every cpp block.

_INCLUDE = re.compile(r"^\s*#\s*include\b.*$", re.M)
_MAIN = re.compile(r"\bint\s+main\s*\(")


def cpp_source(blocks: list[Block]) -> str:
    includes = ["#include <rotary/rotary.h>", "#include <torch/torch.h>"]
    for b in blocks:
        for inc in _INCLUDE.findall(b.code):
            if inc.strip() not in includes:
                includes.append(inc.strip())
    parts = [
        "// Generated from README.md and docs/*.md by tests/docs/test_readme.py: one function per ```cpp block.",
        *includes,
        "#include <cstdio>",
        "#include <cstdlib>",
        "#include <exception>",
        "",
    ]
    calls = []
    for n, b in enumerate(blocks):
        doc = str(b.doc).replace("\\", "/")
        code = _INCLUDE.sub("", b.code)
        cuda_guard = f"  if (!torch::cuda::is_available()) return {SKIP_EXIT};\n" if _needs_cuda(code) else ""
        if _MAIN.search(code):  # a whole program: keep it at namespace scope, call its main
            code = _MAIN.sub("int snippet_main(", code)
            takes_args = not re.search(r"snippet_main\(\s*(void)?\s*\)", code)
            parts += [
                f"namespace readme_{n} {{",
                f'#line {b.line} "{doc}"',
                code,
                "}",
                f"static int snippet_{n}(char** argv) {{",
                cuda_guard + f"  return readme_{n}::snippet_main({'1, argv' if takes_args else ''});",
                "}",
            ]
        else:
            parts += [
                f"static int snippet_{n}(char** /*argv*/) {{",
                *([cuda_guard.rstrip("\n")] if cuda_guard else []),
                "  {",
                f'#line {b.line} "{doc}"',
                code,
                "  }",
                "  return 0;",
                "}",
            ]
        calls.append(f"    case {n}: return snippet_{n}(argv);")
    parts += [
        "",
        "int main(int argc, char** argv) {",
        '  if (argc != 2) { std::fprintf(stderr, "usage: snippets INDEX\\n"); return 2; }',
        "  torch::manual_seed(0);",
        "  try {",
        "    switch (std::atoi(argv[1])) {",
        *calls,
        "    }",
        "  } catch (const std::exception& e) {",
        '    std::fprintf(stderr, "exception: %s\\n", e.what());',
        "    return 1;",
        "  }",
        '  std::fprintf(stderr, "no snippet %s\\n", argv[1]);',
        "  return 2;",
        "}",
        "",
    ]
    return "\n".join(parts)


def cmake_project(librotary: Path) -> str:
    return f"""\
cmake_minimum_required(VERSION 3.25)
project(readme_snippets LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
find_package(Torch REQUIRED)
add_executable(snippets snippets.cpp)
target_include_directories(snippets PRIVATE "{(ROOT / 'csrc').as_posix()}")
# librotary registers the ops when loaded: keep it even if no symbol is used.
target_link_options(snippets PRIVATE "LINKER:--no-as-needed")
target_link_libraries(snippets PRIVATE "{librotary.as_posix()}" ${{TORCH_LIBRARIES}})
set_target_properties(snippets PROPERTIES BUILD_RPATH "{librotary.parent.as_posix()}")
"""


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


@pytest.fixture(scope="session")
def cpp_snippets(request):
    """(path to the compiled binary, None) or (None, build log)."""
    blocks = [b for b in BLOCKS if b.lang in CPP]
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found")
    import rotary

    libs = sorted(Path(rotary.__file__).parent.glob("librotary.so*"))
    if not libs:
        pytest.skip(f"no librotary.so next to {rotary.__file__}; build the package first")
    base = Path(request.config.cache.mkdir("readme-cpp"))
    src, build = base / "src", base / "build"
    src.mkdir(exist_ok=True)
    _write_if_changed(src / "CMakeLists.txt", cmake_project(libs[0]))
    _write_if_changed(src / "snippets.cpp", cpp_source(blocks))
    log = []
    if not (build / "CMakeCache.txt").exists():
        cfg = subprocess.run(
            ["cmake", "-S", src, "-B", build, f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
            capture_output=True, text=True, timeout=600)
        log.append(cfg.stdout + cfg.stderr)
        if cfg.returncode != 0:
            return None, "\n".join(log)
    res = subprocess.run(["cmake", "--build", build], capture_output=True, text=True, timeout=900)
    log.append(res.stdout + res.stderr)
    if res.returncode != 0:
        return None, "\n".join(log)
    return build / "snippets", None


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block: Block, request):
    if block.skip_marked:
        pytest.skip(f"marked {_SKIP_MARK}")
    if block.lang in PYTHON:
        if _needs_cuda(block.code) and not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        # Padding keeps the document's line numbers in tracebacks.
        code = compile("\n" * (block.line - 1) + block.code, str(block.doc), "exec")
        exec(code, python_namespace())
    elif block.lang in CPP:
        binary, log = request.getfixturevalue("cpp_snippets")
        if binary is None:
            pytest.fail(f"compiling the documents' cpp blocks failed:\n{log[-6000:]}", pytrace=False)
        index = [b for b in BLOCKS if b.lang in CPP].index(block)
        res = subprocess.run([binary, str(index)], capture_output=True, text=True, timeout=300)
        if res.returncode == SKIP_EXIT:
            pytest.skip("needs a CUDA device")
        assert res.returncode == 0, f"{block.name}:{block.line} exited {res.returncode}\n{res.stdout}{res.stderr}"
    else:
        pytest.skip(f"not executable: {block.lang or 'plain'} block")


def test_readme_has_runnable_blocks():
    langs = {b.lang for b in BLOCKS if b.doc == README}
    assert langs & PYTHON and langs & CPP, f"README code blocks: {sorted(langs)}"


def test_docs_are_collected():
    """docs/*.md is read: a moved section keeps its blocks under test."""
    names = {b.name for b in BLOCKS}
    for doc in DOCS:
        if "```" in doc.read_text():
            assert doc.relative_to(ROOT).as_posix() in names, f"{doc} has code fences but no block was extracted"
