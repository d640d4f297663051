"""The dependency rules of the layout, checked on the source (docs/architecture.md).

Every import counts, including those inside functions (a lazy import hides a cycle, it does
not remove it):

- ``hscache`` imports nothing from ``scorer`` or ``pipelines``; ``scorer`` nothing from ``pipelines``;
- ``hscache.store`` imports only ``hscache.store.*``, ``hscache.errors`` and ``hscache.schemas``;
- nothing imports a top-level ``schemas``: the schemas ship inside the package as ``hscache.schemas``;
- no import cycles among modules;
- a drafter family is one place (docs/architecture.md "Adding a family"): no module outside
  ``scorer/families/`` imports a family's package (only the registry ``scorer.families`` does), and a
  family imports only the shared layer (and a family it declares it builds on, as DFlash2 on DFlash);
- the scorer by role (docs/architecture.md "Layout"): ``scorer/rules/`` (each engine's verification
  rule) imports no family and none of offline/, online/ or what sits above them; ``scorer/offline/``
  (the replay over cached rows) and ``scorer/online/`` (the target in the loop) may import rules/,
  never each other, and neither imports the studies, the diagnosis, the report or the CLI above them;
  a rule imports only other rules, the error types and hscache's sampling setting and processor;
  ``scorer/report/`` imports none of online/, diagnose/, studies/ or the CLI;
- the sampled case is a rule chosen once (``scorer.offline.sampled_view.served_rule``): no other module
  of offline/, online/, report/ or studies/ calls ``is_sampled`` or builds a ``SampledView``.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hscache", "scorer", "pipelines")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _python_files(root: Path) -> list[Path]:
    """Every .py file under ``root``, following symlinked folders (hscache/schemas -> ../schemas)."""
    return sorted(
        Path(folder) / name
        for folder, _dirs, files in os.walk(root, followlinks=True)
        for name in files
        if name.endswith(".py")
    )


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in _python_files(ROOT / pkg)}


def _lazy_target(node: ast.Call, constants: dict[str, str]) -> str | None:
    """The module of a ``lazy("pkg.mod", "name")`` call (scorer.families.base.lazy: a family's row
    binding a function it imports on first call), its first argument a string or a module-level name
    bound to one; else None."""
    func = node.func
    if not (isinstance(func, ast.Name) and func.id == "lazy") or not node.args:
        return None
    first = node.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return constants.get(first.id) if isinstance(first, ast.Name) else None


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its body (``from pkg import mod`` -> pkg.mod),
    and those its ``lazy(...)`` bindings import when called."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (lazy_module := _lazy_target(node, constants)) is not None:
            targets = [lazy_module]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # `import a.b.c` names module a.b.c; keep the longest project module it names.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


MODULES = _modules()  # walked once: the graph is built at collection
GRAPH = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(source: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if _inside(m, source)
        for t in targets
        if any(_inside(t, f) for f in forbidden)
    )


def test_hscache_imports_neither_scorer_nor_pipelines():
    assert _violations("hscache", ("scorer", "pipelines")) == []


def test_scorer_imports_nothing_from_pipelines():
    assert _violations("scorer", ("pipelines",)) == []


def test_nothing_imports_a_top_level_schemas_module():
    """The repository's schemas/ folder is the package hscache.schemas (a symlink); a top-level
    ``schemas`` name is not installed (another distribution owns it on the package index)."""
    roots = [ROOT / p for p in (*PACKAGES, "tests", "bench")]
    bad = []
    for path in (p for root in roots for p in _python_files(root)):
        text = path.read_text()
        if "schemas" not in text:  # no such import possible: skip the parse (most files)
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            bad += [
                f"{path.relative_to(ROOT)}: {n}" for n in names if n == "schemas" or n.startswith("schemas.")
            ]
    assert bad == []


def test_store_imports_only_store_and_errors():
    allowed = ("hscache.store", "hscache.errors", "hscache.schemas")
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if _inside(m, "hscache.store")
        for t in targets
        if not any(_inside(t, a) for a in allowed)
    )
    assert bad == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    # A package's __init__ re-exporting its modules is not a cycle of the code it re-exports:
    # leave out edges from a package to its own submodules.
    graph = {m: {t for t in ts if not _inside(t, m)} for m, ts in GRAPH.items()}
    assert _cycles(graph) == []


def test_the_checker_sees_lazy_imports_and_cycles():
    source = "def f():\n    from hscache.store import fsio\n"
    tree_imports = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    assert tree_imports == {"hscache.store"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "hscache.store.fsio" in GRAPH["hscache.store.writer"]
    # a family's row binds its functions by name (lazy): those count as its imports
    assert "scorer.families.mtp.seam" in GRAPH["scorer.families.mtp"]
    assert "scorer.families.dflash.seam" in GRAPH["scorer.families.dflash2"]


def _private_imports(path: Path, source: str) -> list[str]:
    """``from project.module import _name`` anywhere in ``source``: another module's private name
    (a module's own ``__all__``-style aliases such as ``import x as _x`` are not imports OF a private)."""
    bad = []
    # A source with no "from <package>... import ... _x" at all cannot hold one: skip its parse (most files;
    # the pattern over-matches, never under-matches: a parenthesised list is read up to its ")").
    candidate = rf"from\s+(?:{'|'.join(PACKAGES)})[\w.]*\s+import\s*\(?[^)]*?(?<![\w.])_(?!_)"
    if not re.search(candidate, source):
        return bad
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            bad += [
                f"{path.relative_to(ROOT) if path.is_absolute() else path}: {node.module}.{alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")
            ]
    return bad


def test_nothing_imports_another_modules_private_name():
    roots = [ROOT / p for p in (*PACKAGES, "tests", "bench")]
    bad = [v for root in roots for p in _python_files(root) for v in _private_imports(p, p.read_text())]
    assert bad == []


def test_the_private_name_check_sees_lazy_imports():
    source = "def f():\n    from hscache.store.fsio import _secret, public\n"
    assert _private_imports(Path("x.py"), source) == ["x.py: hscache.store.fsio._secret"]


# The family packages: every folder under scorer/families/ (dflash, dflash2, eagle3, mtp, ngram).
FAMILY_PACKAGES = sorted(
    f"scorer.families.{p.name}"
    for p in (ROOT / "scorer" / "families").iterdir()
    if (p / "__init__.py").is_file()
)
# A family may build on another (a subclass of its drafter, its loader with a variant).
BUILDS_ON = {
    "scorer.families.dflash2": ("scorer.families.dflash",),
    "scorer.families.peagle": ("scorer.families.eagle3",),
    "scorer.families.dspark": ("scorer.families.dflash",),
}
# What sits above the families: they are called by these, never call them.
ABOVE_FAMILIES = (
    "scorer.cli",
    "scorer.diagnose.run",
    "scorer.make",
    "scorer.offline.scoring",
    "scorer.online",
    "scorer.report",
    "scorer.studies",
    "scorer.families",  # the registry itself (its own module, not the shared base)
)


def _family_of(module: str) -> str | None:
    return next((f for f in FAMILY_PACKAGES if _inside(module, f)), None)


def test_family_packages_are_found():
    assert {"scorer.families.dflash", "scorer.families.eagle3", "scorer.families.mtp"} <= set(FAMILY_PACKAGES)


def test_only_the_registry_imports_a_family():
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if _family_of(m) is None and m != "scorer.families"
        for t in targets
        if _family_of(t) is not None
    )
    assert bad == []


def test_families_import_only_the_shared_layer():
    bad = []
    for m, targets in GRAPH.items():
        own = _family_of(m)
        if own is None:
            continue
        for t in targets:
            other = _family_of(t)
            if other is not None and other != own and other not in BUILDS_ON.get(own, ()):
                bad.append(f"{m} imports the {other} family")
            elif other is None and any(
                t == a or (_inside(t, a) and a != "scorer.families") for a in ABOVE_FAMILIES
            ):
                bad.append(f"{m} imports {t}, which sits above the families")
    assert sorted(bad) == []


def test_the_family_rule_sees_a_violation():
    """The checks above are not vacuous: the registry does import every family."""
    assert {t for t in GRAPH["scorer.families"] if _family_of(t)} >= set(FAMILY_PACKAGES) - {
        "scorer.families.ngram"
    }


def _class_members(cls: ast.ClassDef) -> set[str]:
    """What a class defines: its methods, class-level names and every ``self.X`` its methods set."""
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {
        t.id
        for n in cls.body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    }
    for node in ast.walk(cls):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        names |= {
            t.attr
            for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        }
    return names


def _family_trees(family: str) -> list[ast.Module]:
    return [ast.parse(path.read_text(), str(path)) for m, path in MODULES.items() if _inside(m, family)]


def _added_by_subclasses(family: str, base: str) -> dict[str, set[str]]:
    """Per class of ``family`` that subclasses a class of ``base``: the members none of ``base``'s classes has."""
    base_classes = [n for tree in _family_trees(base) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    base_names = {n.name for n in base_classes}
    base_members = set().union(*(_class_members(c) for c in base_classes))
    return {
        cls.name: _class_members(cls) - base_members
        for tree in _family_trees(family)
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        and any(isinstance(b, ast.Name) and b.id in base_names for b in cls.bases)
    }


def _mentioned(tree: ast.AST) -> set[str]:
    """Every attribute name, name and string constant in ``tree`` (``getattr(x, "name")`` included)."""
    return {
        n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else n.value
        for n in ast.walk(tree)
        if isinstance(n, (ast.Attribute, ast.Name))
        or (isinstance(n, ast.Constant) and isinstance(n.value, str))
    }


def test_a_family_built_on_another_extends_it_by_subclassing():
    """DFlash2 builds on DFlash by subclassing (issue 24): its layer's convolutions and its drafter's
    selector override DFlash's methods, and DFlash's code never names what they add (no
    ``getattr(drafter, "candidate_selector", None)`` sniffing for a variant's attribute)."""
    bad = []
    for family, bases in BUILDS_ON.items():
        for base in bases:
            added = _added_by_subclasses(family, base)
            assert added, f"{family} subclasses none of {base}'s classes"
            mine = set().union(*added.values())
            bad += [
                f"{m} names {name} of {family}"
                for m, path in MODULES.items()
                if _inside(m, base)
                for name in sorted(_mentioned(ast.parse(path.read_text(), str(path))) & mine)
            ]
    assert bad == []


def test_the_subclassing_rule_sees_the_variant_and_a_sniff():
    added = _added_by_subclasses("scorer.families.dflash2", "scorer.families.dflash")
    assert {"attention_conv", "mlp_conv"} <= added["DFlash2Layer"]
    assert "candidate_selector" in added["DFlash2Drafter"]
    # what scorer/families/dflash/ did before DFlash2 overrode DFlashDrafter's drafting methods
    sniff = 'selector = getattr(drafter, "candidate_selector", None)'
    assert _mentioned(ast.parse(sniff)) & set().union(*added.values()) == {"candidate_selector"}


# The scorer by role: what each role folder must not import (every module inside it, lazy imports
# included). rules/ is the bottom: pure functions over drafts and the target's distribution.
ROLE_FORBIDDEN = {
    "scorer.rules": (
        "scorer.families",
        "scorer.offline",
        "scorer.online",
        "scorer.diagnose",
        "scorer.studies",
        "scorer.report",
        "scorer.cli",
    ),
    "scorer.offline": ("scorer.online", "scorer.diagnose", "scorer.studies", "scorer.report", "scorer.cli"),
    "scorer.online": ("scorer.offline", "scorer.diagnose", "scorer.studies", "scorer.report", "scorer.cli"),
    # the report renders what the studies compute: it never calls back up into them
    "scorer.report": ("scorer.online", "scorer.diagnose", "scorer.studies", "scorer.cli"),
}
# What a rule may import at all: other rules, the error types, and the sampling setting and processor
# the target's distribution is made by (hscache). No model, no cache, no metrics.
RULES_MAY_IMPORT = ("scorer.rules", "scorer.errors", "hscache.capture.sampling", "hscache.store.sampling")
# Imports that break the rules above, allowed by name: none is left (issue 32 moved RoundLog and the
# one-hot chain match into rules/onehot_chain.py). The test fails when a new one appears.
ROLE_ALLOWED: set[str] = set()


def _role_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {t}"
        for role, forbidden in ROLE_FORBIDDEN.items()
        for m, targets in graph.items()
        if _inside(m, role)
        for t in targets
        if any(_inside(t, f) for f in forbidden)
    )


def test_the_role_folders_exist():
    for role in ROLE_FORBIDDEN:
        assert any(_inside(m, role) and m != role for m in GRAPH), f"{role} holds no module"


def test_the_roles_import_only_what_sits_below_them():
    assert set(_role_violations(GRAPH)) == ROLE_ALLOWED


def test_the_role_rule_sees_a_violation():
    """Not vacuous: a rule importing a family, and the offline replay importing the online loop, fail."""
    graph = {m: set(ts) for m, ts in GRAPH.items()}
    graph["scorer.rules.vllm_chain"].add("scorer.families.dflash")
    graph["scorer.offline.sequences"].add("scorer.online.greedy")
    graph["scorer.online.sampled"].add("scorer.offline.replay")
    assert set(_role_violations(graph)) - ROLE_ALLOWED == {
        "scorer.rules.vllm_chain imports scorer.families.dflash",
        "scorer.offline.sequences imports scorer.online.greedy",
        "scorer.online.sampled imports scorer.offline.replay",
    }


def test_rules_import_only_what_a_rule_needs():
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if _inside(m, "scorer.rules")
        for t in targets
        if not any(_inside(t, a) for a in RULES_MAY_IMPORT)
    )
    assert bad == []


def _calls(source: str, names: set[str]) -> list[str]:
    """Every call of a function or class named in ``names`` in ``source`` (bare or as an attribute)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else None
            )
            if name in names:
                found.append(name)
    return found


# The sampled case is a rule chosen once (offline/sampled_view.served_rule -> ServedRule), not a branch
# in every layer: outside sampled_view.py, the scoring, report and studies layers never ask whether a
# cache was sampled nor build the sampled view themselves (scorer diagnose's input checks may ask).
RULE_CHOOSERS = {"is_sampled", "SampledView"}


def test_the_sampled_rule_is_chosen_in_one_place():
    layers = [ROOT / "scorer" / d for d in ("offline", "online", "report", "studies")]
    bad = [
        f"{p.relative_to(ROOT)}: {c}"
        for layer in layers
        for p in _python_files(layer)
        if p.name != "sampled_view.py"
        for c in _calls(p.read_text(), RULE_CHOOSERS)
    ]
    assert bad == []
    # not vacuous: what scorer/report/build.py did before the rule was chosen once is caught
    before = "if sampled_view.is_sampled(cache):\n    view = sampled_view.SampledView(cache)\n"
    assert _calls(before, RULE_CHOOSERS) == ["is_sampled", "SampledView"]


# Code that serves or studies drafters of any family (issue 47): it asks the family seam (the registry's
# ``Family.vllm``, ``Family.flags``...) and names no family, so that a new family touches only its folder.
FAMILY_FREE = ("hscache/engines", "scorer/studies", "scorer/cli/served.py")
# Text there that spells a family's name but is not one: hscache's ExtractConfig field ``mtp`` (store the
# target's own head with the cache: an hscache setting the served cache copies from the cache it serves).
NOT_A_FAMILY = {"scorer/studies/vllm_judge.py": ('mtp=bool(cache.settings.get("mtp"))',)}


def _family_words() -> set[str]:
    """Every registered family's name and the vLLM method that serves it, lower-cased."""
    from scorer.families import FAMILIES

    return {f.name.lower() for f in FAMILIES} | {f.vllm.method.lower() for f in FAMILIES if f.vllm}


def _family_names(label: str, source: str, words: set[str]) -> list[str]:
    """``label:line: word`` for each family name in ``source``: code, strings, comments and docstrings,
    split at every character that is not a letter or digit (``_is_ngram`` -> is, ngram) and compared
    lower-cased. A string passed straight to the registry's lookup (``family_named("x")``) is allowed."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source, label)):
        func = node.func if isinstance(node, ast.Call) else None
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name != "family_named":
            continue
        for arg in node.args:
            if isinstance(arg, ast.Constant) and arg.lineno == arg.end_lineno:
                row = lines[arg.lineno - 1]
                lines[arg.lineno - 1] = (
                    row[: arg.col_offset]
                    + " " * (arg.end_col_offset - arg.col_offset)
                    + row[arg.end_col_offset :]
                )
    hits = []
    for number, line in enumerate(lines, 1):
        for allowed in NOT_A_FAMILY.get(label, ()):
            line = line.replace(allowed, "")
        hits += [f"{label}:{number}: {w}" for w in re.split(r"[^a-z0-9]+", line.lower()) if w in words]
    return hits


def _family_free_files() -> list[Path]:
    return [
        p
        for part in FAMILY_FREE
        for p in ([ROOT / part] if part.endswith(".py") else _python_files(ROOT / part))
    ]


def test_engine_and_study_code_names_no_family():
    words = _family_words()
    assert {"dflash", "eagle3", "mtp", "ngram"} <= words
    files = _family_free_files()
    assert len(files) > 10 and (ROOT / "hscache/engines/vllm/worker.py") in files
    bad = [h for p in files for h in _family_names(str(p.relative_to(ROOT)), p.read_text(), words)]
    assert bad == []


def test_the_family_name_check_sees_a_planted_name():
    words = _family_words()
    worker = ROOT / "hscache/engines/vllm/worker.py"
    source = worker.read_text()
    label = "hscache/engines/vllm/worker.py"
    assert _family_names(label, source, words) == []
    planted = {
        'if spec.get("method") == "ngram":\n    pass\n': "ngram",  # a branch on a vLLM method
        "def _is_eagle3(engine):\n    return False\n": "eagle3",  # an identifier
        "x = 1  # DFlash's K is its block - 1\n": "dflash",  # a comment
        '"""Measured on the MTP head."""\n': "mtp",  # a docstring
    }
    for code, word in planted.items():
        found = _family_names(label, source + code, words)
        assert [h.rsplit(": ", 1)[1] for h in found] == [word], code
    # the registry's lookup is the one place a literal name may stand
    assert _family_names(label, source + 'family = family_named("dflash")\n', words) == []
    assert _family_names(label, source + 'family = family_named("dflash") if "dflash" else 0\n', words) != []
