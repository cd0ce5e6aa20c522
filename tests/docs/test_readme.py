"""Runs every fenced code block of README.md and docs/**/*.md.

Fences are found the way CommonMark finds them (markdown-it-py), so a block
is tested exactly as a renderer shows it. Each block must run on its own:
whatever it uses, it defines or imports.
- ```python blocks are executed, each in a fresh, empty namespace.
- ```cpp blocks are wrapped, each in its own function, into ONE generated
  translation unit that is compiled once (a CMake project that does
  find_package(Torch) and links the librotary next to ``rotary.__file__``)
  and then run once per block. The wrapper declares nothing the block could
  use: a block is a function body that includes its headers (#include lines
  are hoisted to the top) and defines its own inputs; a block with its own
  ``int main`` is kept whole and called. #line directives make compiler
  errors point at the document.
  The build lives in .pytest_cache, so reruns are incremental.
- sh, cmake and plain ``` blocks (trees, schemas) are skipped, by language;
  any other language fails until it is added to one of the sets below.
- Only explicit markers skip a runnable block, never the prose around it:
  the line ``<!-- doctest: skip -->`` right before the fence (blank lines
  between are allowed), or a first line ``# requires: cuda`` (``// requires:
  cuda`` in C++), which skips the block when no CUDA device is available.
- Every document's fences must be well formed (test_fences_are_well_formed):
  a line that starts like a fence must open or close one, every fence is
  closed, and an info string is one language word.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON = {"python", "py", "python3"}
CPP = {"cpp", "c++", "cxx"}
NOT_RUN = {"sh", "bash", "console", "cmake", "text", ""}  # "": a plain ``` block
SKIP_EXIT = 77  # a cpp snippet that needs CUDA, run without a GPU


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the first code line in its document
    code: str
    skip_marked: bool = False  # preceded by <!-- doctest: skip -->
    doc: Path = README
    requires: tuple[str, ...] = ()  # from a first line "# requires: cuda"

    @property
    def name(self) -> str:
        return self.doc.relative_to(ROOT).as_posix()

    @property
    def id(self) -> str:
        return f"{self.name}:L{self.line}-{self.lang or 'plain'}"


_SKIP_MARK = "<!-- doctest: skip -->"
_REQUIRES = re.compile(r"^\s*(?:#|//)\s*requires:\s*(.*?)\s*$")
_KNOWN_REQUIREMENTS = {"cuda"}
_MD = MarkdownIt("commonmark")
# List indentation and blockquote markers in front of a line's own text.
_CONTAINER = re.compile(r"^[ \t>]*")
_FENCE_LIKE = re.compile(r"^(`{3,}|~{3,})")
_INFO = re.compile(r"^[A-Za-z0-9_.+-]*$")  # one language word, nothing else


def _requirements(code: str) -> tuple[str, ...]:
    first = next((line for line in code.splitlines() if line.strip()), "")
    m = _REQUIRES.match(first)
    return tuple(v.strip() for v in m.group(1).split(",")) if m else ()


def extract_blocks(text: str, doc: Path = README) -> list[Block]:
    """Fenced blocks as CommonMark parses them, in document order."""
    tokens = _MD.parse(text)
    blocks = []
    for i, tok in enumerate(tokens):
        if tok.type != "fence":
            continue
        info = tok.info.strip()
        lang = info.split()[0].lower() if info else ""
        prev = tokens[i - 1] if i else None
        marked = prev is not None and prev.type == "html_block" and prev.content.strip() == _SKIP_MARK
        blocks.append(Block(lang, tok.map[0] + 2, tok.content, marked, doc, _requirements(tok.content)))
    return blocks


def fence_problems(text: str) -> list[str]:
    """Fences that do not render as their author meant, one message each."""
    lines = text.splitlines()
    tokens = _MD.parse(text)
    problems = []
    accounted = set()  # lines that open, close or sit inside a fence

    def own(n: int) -> str:
        return _CONTAINER.sub("", lines[n]) if n < len(lines) else ""

    def indent(n: int) -> int:
        text = lines[n].lstrip(" \t>") if lines[n].lstrip(" \t").startswith(">") else lines[n]
        return len(text) - len(text.lstrip(" "))

    for tok in tokens:
        if tok.type == "html_block" and tok.content.strip().startswith("<!-- doctest") \
                and tok.content.strip() != _SKIP_MARK:
            problems.append(f"line {tok.map[0] + 1}: unknown doctest marker {tok.content.strip()!r}; "
                            f"the only one is {_SKIP_MARK!r}")
        if tok.type != "fence":
            continue
        first, end = tok.map  # [opening line, one past the last line), 0-based
        accounted.update(range(first, end))
        char, n = tok.markup[0], len(tok.markup)
        info = tok.info.strip()
        if not _INFO.match(info):
            problems.append(f"line {first + 1}: info string {info!r} is more than a language word")
        closer = re.compile(rf"^{re.escape(char)}{{{n},}}[ \t]*$")
        last = end - 1
        closed = last > first and closer.match(own(last))
        if not closed:
            problems.append(f"line {first + 1}: fence {tok.markup}{info} is never closed")
        for j in range(first + 1, last if closed else end):
            # Indented 4 or more past the opener, it is plainly content.
            if own(j).startswith(char * n) and indent(j) - indent(first) <= 3:
                problems.append(
                    f"line {j + 1}: starts with {char * n} but has text after it, so it does not close "
                    f"the block opened at line {first + 1} (put the text on its own line)")
        req = set(_requirements(tok.content)) - _KNOWN_REQUIREMENTS
        if req:
            problems.append(f"line {first + 2}: unknown requirement {sorted(req)}; known: {sorted(_KNOWN_REQUIREMENTS)}")
    for j in range(len(lines)):
        if j not in accounted and _FENCE_LIKE.match(own(j)):
            problems.append(f"line {j + 1}: looks like a fence but opens no fenced block "
                            f"(indented code, or an info string with a backtick): {lines[j].strip()!r}")
    return problems


BLOCKS = [b for doc in DOCS for b in extract_blocks(doc.read_text(), doc)]


def _needs_cuda(block: Block) -> bool:
    return "cuda" in block.requires


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
        cuda_guard = f"  if (!torch::cuda::is_available()) return {SKIP_EXIT};\n" if _needs_cuda(b) else ""
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
        if _needs_cuda(block) and not torch.cuda.is_available():
            pytest.skip("marked '# requires: cuda', and no CUDA device")
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
            pytest.skip("marked '// requires: cuda', and no CUDA device")
        assert res.returncode == 0, f"{block.name}:{block.line} exited {res.returncode}\n{res.stdout}{res.stderr}"
    elif block.lang in NOT_RUN:
        pytest.skip(f"not executable: {block.lang or 'plain'} block")
    else:
        pytest.fail(f"{block.name}:{block.line}: no rule for language {block.lang!r}; add it to PYTHON, CPP "
                    "or NOT_RUN in tests/docs/test_readme.py", pytrace=False)


def test_readme_has_runnable_blocks():
    langs = {b.lang for b in BLOCKS if b.doc == README}
    assert langs & PYTHON and langs & CPP, f"README code blocks: {sorted(langs)}"


def test_docs_are_collected():
    """docs/*.md is read: a moved section keeps its blocks under test."""
    names = {b.name for b in BLOCKS}
    for doc in DOCS:
        if "```" in doc.read_text():
            assert doc.relative_to(ROOT).as_posix() in names, f"{doc} has code fences but no block was extracted"


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_fences_are_well_formed(doc: Path):
    problems = fence_problems(doc.read_text())
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)


_GOOD = "text\n\n```python\nx = 1\n```\n\n- item\n\n  ~~~cpp\n  int x = 1;\n  ~~~\n\n````\n```python\n````\n"


@pytest.mark.parametrize("sample, expect", [
    # A closing fence with text after it: the block runs on to the next bare fence.
    ("```python\nx = 1\n``` and then prose\n\nmore\n\n```python\ny = 2\n```\n", "does not close"),
    ("text\n\n```python\nx = 1\n", "never closed"),
    ("```python this one needs CUDA\nx = 1\n```\n", "more than a language word"),
    ("para\n\n    ```python\n    x = 1\n    ```\n", "opens no fenced block"),
    ("``` `code` then prose\n", "opens no fenced block"),
    ("<!-- doctest: skipp -->\n```python\nx = 1\n```\n", "unknown doctest marker"),
    ("```python\n# requires: gpu\nx = 1\n```\n", "unknown requirement"),
])
def test_fence_check_catches_malformed(sample: str, expect: str):
    problems = fence_problems(sample)
    assert any(expect in p for p in problems), problems
    assert fence_problems(_GOOD) == []


def test_markers_are_read_from_the_block_not_the_prose():
    text = ("A CUDA example:\n\n```python\nx = 1  # no cuda needed\n```\n\n<!-- doctest: skip -->\n\n"
            "```python\ny = 2\n```\n\n```cpp\n// requires: cuda\nint z = 3;\n```\n")
    a, b, c = extract_blocks(text)
    assert (a.skip_marked, a.requires, a.line, a.code) == (False, (), 4, "x = 1  # no cuda needed\n")
    assert b.skip_marked and not c.skip_marked and c.requires == ("cuda",)
