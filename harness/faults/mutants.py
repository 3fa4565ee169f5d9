"""Mutants of installed upstream code (issue 41): one small source change each, at a known span.

The mutation libraries on the index work on a project's own tree: mutmut 3 copies the project into
mutants/ and runs its own test runner over trampolines, cosmic-ray edits the module file in place
(installed files are never edited here), poodle copies the project into temp folders. None can
target megatron.core or megatron.bridge as installed and leave them untouched, so this is a small
AST mutator: Python's own `ast` finds each mutation point with its exact source span, and a mutant
is the original text with that one span replaced. Line numbers never move (a replacement spanning
lines is padded with newlines), so coverage lines and tracebacks of a mutated module are the
installed file's. A mutant is loaded by harness.faults.mutant_hook, never written.

The operators are the ones that matter for checkpoints: comparison and boolean flips, `not`
dropped, True/False and numbers changed, off-by-one on slice bounds, indices and range ends, the
first two positional arguments swapped, a statement or a dict entry dropped, a return replaced by
None or by its call's first argument, and flag-like keyword arguments (strict, is_loading, ...)
inverted. The same source and seed give the same mutants, in the same order.
"""

from __future__ import annotations

import ast
import bisect
import difflib
import hashlib
import random
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

OPERATORS = ("compare-flip", "bool-flip", "not-dropped", "constant", "off-by-one", "swap-args",
             "drop-statement", "drop-dict-entry", "return-none", "return-arg", "flag-invert")
_FLIP = {"<": ">=", ">=": "<", ">": "<=", "<=": ">", "==": "!=", "!=": "==", "is not": "is", "is": "is not",
         "not in": "in", "in": "not in"}
_CMP_TOKEN = re.compile(r"is\s+not|not\s+in|==|!=|<=|>=|<|>|\bis\b|\bin\b")
_BOOL_TOKEN = re.compile(r"\band\b|\bor\b")
#: a statement whose only effect is a message: dropping it is no checkpoint defect
_QUIET_ROOTS = {"logger", "logging", "log", "warnings", "print", "print_rank_0", "print_rank_last", "_logger", "LOGGER"}
#: keyword arguments that only change how a value prints (dataclasses.field(repr=...)): left alone, as log lines
_DISPLAY_ONLY = {"repr"}
#: keyword arguments that are switches (their value inverted is a mutant even when it is not a literal)
_FLAG = re.compile(r"^(strict|is_[a-z_]+|use_[a-z_]+|allow_[a-z_]+|skip_[a-z_]+|validate[a-z_]*|"
                   r"fully_[a-z_]+|[a-z_]*_only|async_[a-z_]+|with_[a-z_]+|keep_vars|non_blocking)$")


@dataclass(frozen=True)
class Mutant:
    """One change at one span of one installed module (lines 1-based, columns 0-based, as ast)."""

    module: str
    path: str
    sha256: str  # of the installed file as read: a mutant of other bytes is refused at load
    line: int
    col: int
    end_line: int
    end_col: int
    operator: str
    original: str
    replacement: str
    function: str  # the enclosing function's qualified name ('' at module level)
    #: the span runs when the module is imported (module level, a class body, a decorator or default),
    #: not when a function of it is called: every case that imports the module runs it
    at_import: bool = False

    @property
    def id(self) -> str:
        digest = hashlib.sha256(f"{self.line}:{self.col}:{self.end_line}:{self.end_col}:{self.replacement}".encode()).hexdigest()[:8]
        return f"{self.module}:{self.line}:{self.operator}:{digest}"

    def apply(self, text: str) -> str:
        """`text` (the installed file's) with this mutant's span replaced, lines kept in place."""
        starts = _line_starts(text)
        a, b = _offset(starts, text, self.line, self.col), _offset(starts, text, self.end_line, self.end_col)
        if text[a:b] != self.original:
            raise ValueError(f"mutant {self.id}: {self.path}:{self.line} no longer holds {self.original!r}")
        pad = "\n" * (self.original.count("\n") - self.replacement.count("\n"))
        return text[:a] + self.replacement + pad + text[b:]

    def diff(self, text: str) -> str:
        return "".join(difflib.unified_diff(text.splitlines(True), self.apply(text).splitlines(True),
                                            f"a/{self.module}", f"b/{self.module}", n=1))

    def equivalent(self, text: str) -> bool:
        """The mutated module compiles to the same code as the original (a survivor then is no blind spot)."""
        try:
            return _compiled(text, self.path) == _compiled(self.apply(text), self.path)
        except SyntaxError:
            return False

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Mutant":
        return cls(**{k: v for k, v in raw.items() if k != "id"})


def _line_starts(text: str) -> list[int]:
    return [0, *(m.end() for m in re.finditer("\n", text))]


def _offset(starts: list[int], text: str, line: int, col: int) -> int:
    """ast's (line, UTF-8 byte column) as a str offset."""
    begin = starts[line - 1]
    end = starts[line] if line < len(starts) else len(text)
    return begin + len(text[begin:end].encode()[:col].decode(errors="ignore"))


@lru_cache(maxsize=4)
def _compiled(text: str, path: str) -> Any:
    """_code_key of a module's text; the installed original's is computed once, not once per mutant."""
    return _code_key(compile(text, path, "exec"))


def _code_key(code: Any) -> Any:
    """What a code object executes: its instructions with their resolved arguments (names and constants
    by value, nested code objects recursively), not its line table nor the order of its name tables
    (f(a, b) and f(b, a) compile to the same bytes over differently ordered co_names)."""
    import dis

    return tuple((ins.opname, _code_key(ins.argval) if hasattr(ins.argval, "co_code") else repr(ins.argval))
                 for ins in dis.get_instructions(code))


def locate(module: str) -> Path:
    """The installed source file of `module`, found package by package on sys.path without importing
    any of them (importlib.util.find_spec would run every parent package's __init__)."""
    from importlib.machinery import PathFinder

    spec, path = None, None
    parts = module.split(".")
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), path)
        if spec is None:
            raise ValueError(f"{module}: not found on sys.path (at {'.'.join(parts[:i + 1])})")
        path = spec.submodule_search_locations
    if not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"{module}: no Python source to mutate (origin {spec.origin!r})")
    return Path(spec.origin)


def generate(module: str, path: Path | None = None) -> list[Mutant]:
    """Every mutant of `module`'s installed source, in source order (then operator, replacement)."""
    path = Path(path) if path else locate(module)
    text = path.read_text()
    sha = hashlib.sha256(text.encode()).hexdigest()
    tree = ast.parse(text)
    found = {(m.line, m.col, m.end_line, m.end_col, m.operator, m.replacement): m
             for m in _Points(module, str(path), sha, text).points(tree)}
    return [found[k] for k in sorted(found)]


def sample(mutants: list[Mutant], n: int | None, seed: int) -> list[Mutant]:
    """`n` of them, the same for the same list and seed, in their own order (all when n is None or more).

    Stratified by module: each module gets an equal share of `n` (a module with fewer mutants gives
    its spare share to the others), so a campaign over a large and a small module still measures
    both. One module: exactly `random.Random(seed).sample` over its mutants."""
    if n is None or n >= len(mutants):
        return list(mutants)
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(mutants):
        groups.setdefault(m.module, []).append(i)
    share = {mod: 0 for mod in groups}
    left = n
    while left:
        open_ = [mod for mod in groups if share[mod] < len(groups[mod])]
        each, extra = divmod(left, len(open_))
        for j, mod in enumerate(open_):
            share[mod] += min(each + (j < extra), len(groups[mod]) - share[mod])
        left = n - sum(share.values())
    rng = random.Random(seed)
    picked = {i for mod, idx in groups.items() for i in (rng.sample(idx, share[mod]) if share[mod] < len(idx) else idx)}
    return [m for i, m in enumerate(mutants) if i in picked]


def in_functions(mutants: list[Mutant], pattern: str) -> list[Mutant]:
    """The mutants whose enclosing function's qualified name matches `pattern` (fnmatch; `|` between
    alternatives): `megatron.core.optimizer.distrib_optimizer:*state*` aims at its state-dict paths."""
    from fnmatch import fnmatchcase

    alternatives = [p for p in pattern.split("|") if p]
    return [m for m in mutants if any(fnmatchcase(m.function, p) for p in alternatives)]


class _Points(ast.NodeVisitor):
    """The mutation points of one module's tree, each as a Mutant."""

    def __init__(self, module: str, path: str, sha: str, text: str):
        self.module, self.path, self.sha, self.text = module, path, sha, text
        self.starts = _line_starts(text)
        self.scope: list[str] = []
        self.in_function = 0  # how many function bodies enclose the visit
        self.out: list[Mutant] = []

    def points(self, tree: ast.AST) -> list[Mutant]:
        self.visit(tree)
        return self.out

    # -- helpers
    def _seg(self, line: int, col: int, end_line: int, end_col: int) -> str:
        return self.text[self._at(line, col):self._at(end_line, end_col)]

    def _add(self, op: str, line: int, col: int, end_line: int, end_col: int, replacement: str) -> None:
        original = self._seg(line, col, end_line, end_col)
        if original != replacement and original.strip():
            self.out.append(Mutant(self.module, self.path, self.sha, line, col, end_line, end_col, op, original,
                                   replacement, ".".join(self.scope), self.in_function == 0))

    def _add_offsets(self, op: str, a: int, b: int, replacement: str) -> None:
        (line, col), (end_line, end_col) = self._pos(a), self._pos(b)
        self._add(op, line, col, end_line, end_col, replacement)

    def _pos(self, offset: int) -> tuple[int, int]:
        """A str offset as ast's (line, UTF-8 byte column)."""
        line = bisect.bisect_right(self.starts, offset)
        return line, len(self.text[self.starts[line - 1]:offset].encode())

    def _at(self, line: int, col: int) -> int:
        return _offset(self.starts, self.text, line, col)

    def _node(self, op: str, node: ast.AST, replacement: str) -> None:
        self._add(op, node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, replacement)

    def _text(self, node: ast.AST) -> str:
        return self._seg(node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)

    def _gap(self, op: str, left: ast.AST, right: ast.AST, pattern: re.Pattern, table: dict[str, str]) -> None:
        """Flip the operator token between two operands (the gap may hold parentheses)."""
        gap = self._seg(left.end_lineno, left.end_col_offset, right.lineno, right.col_offset)
        m = pattern.search(gap)
        if m is None:
            return
        token = re.sub(r"\s+", " ", m.group(0))
        if token in table:
            self._add(op, left.end_lineno, left.end_col_offset, right.lineno, right.col_offset,
                      gap[:m.start()] + table[token] + gap[m.end():])

    # -- scopes
    def _scoped(self, node: ast.AST) -> None:
        if isinstance(node, ast.ClassDef):
            self.scope.append(node.name)
            self.generic_visit(node)
            self.scope.pop()
            return
        # decorators and defaults run where the def is (at import for a module-level def); then the body;
        # never the annotations (types, not behaviour)
        for child in (*node.decorator_list, *node.args.defaults, *(d for d in node.args.kw_defaults if d)):
            self.visit(child)
        self.scope.append(node.name)
        self.in_function += 1
        for child in node.body:
            self.visit(child)
        self.in_function -= 1
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._node("drop-statement", node, "pass")
            self.visit(node.value)

    # -- operators
    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a docstring
        if isinstance(node.value, ast.Call):
            if _root(node.value.func) in _QUIET_ROOTS:
                return  # a statement that only logs
            self._node("drop-statement", node, "pass")
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        value = node.value
        if isinstance(value, ast.Call) and (getattr(value.func, "attr", None) or getattr(value.func, "id", None)) == "getLogger":
            return  # `logger = logging.getLogger(...)`: only the log lines use it, and they are left alone
        self._node("drop-statement", node, "pass")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._node("drop-statement", node, "pass")
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        if _root(node.test) == "TYPE_CHECKING":
            return
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        left = node.left
        for right in node.comparators:
            self._gap("compare-flip", left, right, _CMP_TOKEN, _FLIP)
            left = right
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        for left, right in zip(node.values, node.values[1:]):
            self._gap("bool-flip", left, right, _BOOL_TOKEN, {"and": "or", "or": "and"})
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self._add("not-dropped", node.lineno, node.col_offset, node.operand.lineno, node.operand.col_offset, "")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        v = node.value
        if v is True or v is False:
            self._node("constant", node, repr(not v))
        elif isinstance(v, int) and not isinstance(v, bool):
            self._node("constant", node, repr(v + 1))
            if v != 0:
                self._node("constant", node, repr(v - 1))

    def visit_Slice(self, node: ast.Slice) -> None:
        for bound in (node.lower, node.upper):
            if bound is not None:
                self._node("off-by-one", bound, f"({self._text(bound)}) + 1")
                self._node("off-by-one", bound, f"({self._text(bound)}) - 1")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        index = node.slice
        if not isinstance(index, (ast.Slice, ast.Tuple, ast.Constant)):  # a computed index: a name, an offset
            self._node("off-by-one", index, f"({self._text(index)}) + 1")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        args = [a for a in node.args if not isinstance(a, ast.Starred)]
        if _root(node.func) == "range" and args:
            end = args[1] if len(args) > 1 else args[0]
            self._node("off-by-one", end, f"({self._text(end)}) - 1")
        if len(args) >= 2 and args[:2] == node.args[:2]:
            a, b = args[0], args[1]
            middle = self._seg(a.end_lineno, a.end_col_offset, b.lineno, b.col_offset)
            self._add("swap-args", a.lineno, a.col_offset, b.end_lineno, b.end_col_offset,
                      self._text(b) + middle + self._text(a))
        for kw in node.keywords:
            if kw.arg and _FLAG.match(kw.arg) and not isinstance(kw.value, ast.Constant):
                self._node("flag-invert", kw.value, f"not ({self._text(kw.value)})")
        self.visit(node.func)
        for child in (*node.args, *(kw for kw in node.keywords if kw.arg not in _DISPLAY_ONLY)):
            self.visit(child)

    def visit_Dict(self, node: ast.Dict) -> None:
        """Drop one `key: value` entry with one of its commas (a `**spread` is never dropped)."""
        entries = list(zip(node.keys, node.values))
        for i, (k, v) in enumerate(entries):
            if k is None:
                continue
            if i + 1 < len(entries):  # up to where the next entry starts (its key, or its `**`)
                nk, nv = entries[i + 1]
                end = self._at(nk.lineno, nk.col_offset) if nk is not None else \
                    self.text.index("**", self._at(v.end_lineno, v.end_col_offset))
                self._add_offsets("drop-dict-entry", self._at(k.lineno, k.col_offset), end, "")
            elif i > 0:  # the last entry: from the end of the one before (its comma goes with it)
                pv = entries[i - 1][1]
                self._add_offsets("drop-dict-entry", self._at(pv.end_lineno, pv.end_col_offset),
                                  self._at(v.end_lineno, v.end_col_offset), "")
            else:
                self._add("drop-dict-entry", k.lineno, k.col_offset, v.end_lineno, v.end_col_offset, "")
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        v = node.value
        if v is not None and not (isinstance(v, ast.Constant) and v.value is None):
            self._node("return-none", v, "None")
            if isinstance(v, ast.Call) and v.args and not isinstance(v.args[0], ast.Starred):
                self._node("return-arg", v, self._text(v.args[0]))
        self.generic_visit(node)


def _root(node: ast.AST) -> str:
    """The first name of a dotted expression (`logger` of logger.info, `range` of range)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""

