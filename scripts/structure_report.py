"""How many rules still have a second home: the structure figures of issue 35, measured on the package.

    python scripts/structure_report.py [--package autocompress_nemo] [--list]

Prints one JSON object:

- ``kind_switches``: lines outside ``blocks/``, ``arch/`` and the format writers (``export/``,
  ``models/``) that branch on a block kind (``.kind ==``, ``kind in (...)``, ``isinstance(x,
  AttentionBlock)``...);
- ``engine_switches``: lines outside ``costs/engines/`` that branch on an engine's name;
- ``method_switches``: lines that compare a method's name (``method ==``, ``== "minitron_pp"``)
  outside the method registry (``stages/common.py``);
- ``local_imports``: ``import`` statements inside functions (optional dependencies included);
- ``long_functions``: functions over 80 lines (name, file, lines);
- ``lines``: lines of Python in the package.

``--list`` adds every counted line. ``tests/test_structure.py`` bounds each figure by what it was
when the test was last tightened (they may fall, never rise); issue 35's goals are listed there.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

_KINDS = r"[\"'](attention|mlp|moe|mamba)[\"']"
KIND = re.compile(
    rf"(\bkind\s*[!=]=\s*{_KINDS}|{_KINDS}\s*[!=]=\s*\w*\.?kind\b|\bkind\s+(not\s+)?in\s*[(\[{{]\s*{_KINDS}|"
    r"isinstance\([^)]*\b(AttentionBlock|MlpBlock|MoeBlock|MambaBlock)\b)"
)
ENGINE = re.compile(r"[!=]=\s*[\"'](llama_cpp|llama_cpp_hybrid|vllm|vllm_cpu|trtllm|roofline|torch_eager|hf_llm)[\"']")
_METHODS = r"[\"'](autocompress|minitron_pp)[\"']"
METHOD = re.compile(rf"([!=]=\s*{_METHODS}|{_METHODS}\s*[!=]=|\bin\s*[(\[{{]\s*{_METHODS})")
KIND_HOMES = ("blocks/", "arch/", "export/", "models/")
ENGINE_HOMES = ("costs/engines/",)
METHOD_HOMES = ("stages/common.py",)


def _lines(root: Path, pattern: re.Pattern[str], homes: tuple[str, ...]) -> list[str]:
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(homes) or rel in homes:
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code):
                out.append(f"{rel}:{n}: {line.strip()}")
    return out


def _functions(root: Path) -> tuple[list[str], list[str]]:
    local, long = [], []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 80:
                    long.append(f"{rel}:{node.lineno}: {node.name} ({n} lines)")
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Import | ast.ImportFrom) and sub is not node:
                        local.append(f"{rel}:{sub.lineno}")
    return sorted(set(local)), long


def report(package: Path) -> dict:
    kinds = _lines(package, KIND, KIND_HOMES)
    engines = _lines(package, ENGINE, ENGINE_HOMES)
    methods = _lines(package, METHOD, METHOD_HOMES)
    local, long = _functions(package)
    lines = sum(len(f.read_text().splitlines()) for f in package.rglob("*.py"))
    return {
        "kind_switches": kinds,
        "engine_switches": engines,
        "method_switches": methods,
        "local_imports": local,
        "long_functions": long,
        "lines": lines,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default=str(Path(__file__).resolve().parents[1] / "autocompress_nemo"))
    ap.add_argument("--list", action="store_true", help="print every counted line, not only the counts")
    a = ap.parse_args()
    r = report(Path(a.package))
    out = {k: (v if a.list or not isinstance(v, list) else len(v)) for k, v in r.items()}
    if not a.list:
        out["long_functions_list"] = r["long_functions"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
