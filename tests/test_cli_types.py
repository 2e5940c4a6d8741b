"""Below each CLI's ``main`` / ``build_parser`` / ``parse_args``, functions take typed options (`Job`,
`Workload`, `Regime`, a frozen dataclass), never the parsed ``argparse.Namespace``. Reads the source only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared_configs", "torch_impl", "jax_impl", "benchmarks")
ENTRY = {"main", "build_parser", "parse_args"}
NAMESPACE_NAMES = {"args", "ns", "namespace", "parsed"}  # an unannotated parameter read as args.x


def _namespace_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    read = {n.value.id for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    return [
        p.arg
        for p in params
        if (p.annotation is not None and "Namespace" in ast.unparse(p.annotation))
        or (p.annotation is None and p.arg in NAMESPACE_NAMES and p.arg in read)
    ]


def test_no_function_below_a_cli_entry_takes_a_namespace() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for fn in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and fn.name not in ENTRY:
                    found += [f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}({p})" for p in _namespace_params(fn)]
    assert found == []


def test_the_scan_finds_a_namespace_taken() -> None:
    source = "def f(args: argparse.Namespace): pass\ndef g(args):\n    return args.x\ndef main(args): args.y"
    fns = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
    assert [_namespace_params(fn) for fn in fns] == [["args"], ["args"], ["args"]]
