"""docs/architecture.md stays true to the code: every file it names exists, every module and function it names is
where it says, and its stage table ("Who runs each stage") matches the pipelines.

The checker (:func:`doc_problems`) reads the document's text and the source files with ``ast``; it imports nothing of
gpuaccept (no torch), so it runs in well under a second. What it checks:

- a repository path (``core/…``, ``tui/…``, ``tests/…``, ``benchmarks/…``, ``examples/…``, ``docs/…``) or a relative
  markdown link exists;
- a dotted module name (``core.x.y``, ``tui.x``, ``tests.x``) is a module file or package, and what follows the module
  (``core.record.build.verdict``, ``core.pipeline.AcceptanceRun.write_record``) is defined in it;
- ``core/x.py``'s ``name``, ``core/x.py::Name.attr`` and ``core/x.py`` (``A``, ``B``) name definitions of that file;
- each row of the stage table: its events method exists and emits ``StageStarted`` / ``StageFinished`` with the row's
  stage name; each function of its work exists in its module and the pipeline module imports it from there; the rows of
  each pipeline are its ``STAGES``, in order.
"""

from __future__ import annotations

import ast
import functools
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"

_TOP = r"(?:core|tui|tests|benchmarks|examples|docs)"
#: a repository path: ``core/plan/fit.py``, ``tests/data/records/``, ``benchmarks/results/gpu/``
PATH_RE = re.compile(rf"(?<![\w./-])({_TOP}/(?:[\w./-]*[\w/])?)")
#: a dotted module name, maybe followed by what it defines: ``core.child.worker``, ``core.record.build.verdict``
DOTTED_RE = re.compile(r"(?<![\w./-])((?:core|tui|tests)(?:\.\w+)+)")
#: a relative markdown link: ``[plan.md](plan.md)``
LINK_RE = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_PY = rf"{_TOP}/[\w/]*\.py"
#: ``core/x.py::Name.attr`` (the stage table's form)
QUALIFIED_RE = re.compile(rf"`({_PY})::(\w+(?:\.\w+)*)`")
#: ``core/x.py``'s ``name``
POSSESSIVE_RE = re.compile(rf"`({_PY})`'s\s+`(\w+(?:\.\w+)*)`")
#: ``core/x.py`` (``A``, ``B``): a path followed by a list of its names and nothing else
LISTED_RE = re.compile(rf"`({_PY})`\s+\(((?:`\w+`,\s*)*`\w+`)\)")
STAGE_TABLE_HEADER = "| pipeline | stage | its events | its work |"
EVENT_CLASSES = ("StageStarted", "StageFinished")

_trees: dict[tuple[str, int, int], ast.Module] = {}


def _tree(path: Path) -> ast.Module:
    """The parsed source of ``path``, parsed once per version of the file (a link is its target)."""
    path = path.resolve()
    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _trees:
        _trees[key] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return _trees[key]


def _module_file(parts: list[str], root: Path) -> Path | None:
    """The file of the module ``parts`` (``["core", "plan", "fit"]``): a ``.py`` file or a package's ``__init__.py``."""
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defined(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The statement of ``body`` that defines ``name``: a def, a class, an assignment or an import."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names):
            return node
    return None


def _resolve(path: Path, qualname: str) -> ast.AST | None:
    """The definition of ``qualname`` (``verdict``, ``AcceptanceRun.plan_stage``) in the file ``path``, or None."""
    body: list[ast.stmt] = _tree(path).body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = _defined(body, part)
        if node is None:
            return None
        body = node.body if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else []
    return node


def _symbol_problem(rel: str, qualname: str, root: Path) -> str | None:
    path = root / rel
    if not path.is_file():
        return f"{rel}: no such file (named with {qualname!r})"
    if _resolve(path, qualname) is None:
        return f"{rel}: defines no {qualname!r}"
    return None


def _dotted_problem(name: str, root: Path) -> str | None:
    """None when ``name`` is a module, or a module followed by names it defines (``core.record.build.verdict``)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        file = _module_file(parts[:k], root)
        if file is None:
            continue
        rest = ".".join(parts[k:])
        if rest and _resolve(file, rest) is None:
            return f"{name}: module {'.'.join(parts[:k])} defines no {rest!r}"
        return None
    return f"{name}: no such module"


_imports: dict[int, dict[str, set[str]]] = {}


def _imported_from(tree: ast.Module, module: str) -> set[str]:
    """Every name ``tree`` imports from ``module`` (``from module import a, b``, at any depth)."""
    if id(tree) not in _imports:  # the trees are kept (_trees): an id stays theirs
        by_module: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                by_module.setdefault(node.module, set()).update(a.name for a in node.names)
        _imports[id(tree)] = by_module
    return _imports[id(tree)].get(module, set())


def _stage_names(fn: ast.AST) -> set[str]:
    """The stage names ``fn`` passes first to ``StageStarted`` / ``StageFinished``."""
    return {call.args[0].value for call in ast.walk(fn)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in EVENT_CLASSES
            and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)}


def _stages_tuple(path: Path) -> tuple[str, ...] | None:
    """The module's ``STAGES = ("plan", ...)``, or None."""
    node = _defined(_tree(path).body, "STAGES")
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
        return tuple(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    return None


def _dotted(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _stage_table_lines(text: str) -> list[str]:
    """The lines of the stage table's rows (after its header and separator), or [] when there is none."""
    lines = text.splitlines()
    try:
        start = [line.strip() for line in lines].index(STAGE_TABLE_HEADER)
    except ValueError:
        return []
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def stage_table(text: str) -> list[tuple[str, str, str, list[str]]]:
    """The rows of the stage table: (pipeline path, stage, events ``path::qualname``, work ``path::name`` list)."""
    rows = []
    for line in _stage_table_lines(text):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4:
            rows.append(("", "", line, []))
            continue
        pipeline, stage, events, work = cells
        rows.append((pipeline.strip("`"), stage, events.strip("`"), re.findall(r"`([^`]+)`", work)))
    return rows


def _stage_table_problems(text: str, root: Path) -> list[str]:
    rows = stage_table(text)
    if not rows:
        return [f"no stage table (a table headed {STAGE_TABLE_HEADER!r})"]
    problems: list[str] = []
    order: dict[str, list[str]] = {}
    for pipeline, stage, events, work in rows:
        where = f"stage table, {pipeline} {stage}"
        if not pipeline:
            problems.append(f"stage table: a row without four cells: {events}")
            continue
        order.setdefault(pipeline, []).append(stage)
        pipe_path = root / pipeline
        if not pipe_path.is_file():
            problems.append(f"{where}: no such file {pipeline}")
            continue
        rel, _, qualname = events.partition("::")
        problem = _symbol_problem(rel, qualname, root) if qualname else f"{events}: not path::name"
        if problem:
            problems.append(f"{where}: {problem}")
        else:
            emitted = _stage_names(_resolve(root / rel, qualname))
            if stage not in emitted:
                problems.append(f"{where}: {events} emits no StageStarted/StageFinished({stage!r}) "
                                f"(it emits {sorted(emitted)})")
        if not work:
            problems.append(f"{where}: no work named")
        for item in work:
            rel, _, name = item.partition("::")
            problem = _symbol_problem(rel, name, root) if name else f"{item}: not path::name"
            if problem:
                problems.append(f"{where}: {problem}")
                continue
            module = _dotted(rel)
            if name.split(".")[0] not in _imported_from(_tree(pipe_path), module):
                problems.append(f"{where}: {pipeline} does not import {name} from {module}")
    for pipeline, stages in order.items():
        pipe_path = root / pipeline
        if pipe_path.is_file():
            declared = _stages_tuple(pipe_path)
            if declared is None:
                problems.append(f"stage table: {pipeline} has no STAGES tuple")
            elif tuple(stages) != declared:
                problems.append(f"stage table: the rows of {pipeline} are {tuple(stages)}, its STAGES {declared}")
    return problems


def doc_problems(text: str, root: Path = ROOT) -> list[str]:
    """Every statement of the document ``text`` about the tree at ``root`` that the tree contradicts, as one line each
    (empty: the document is true to the code)."""
    problems: list[str] = []
    seen: set[str] = set()

    def once(problem: str | None) -> None:
        if problem and problem not in seen:
            seen.add(problem)
            problems.append(problem)

    for path in PATH_RE.findall(text):
        once(None if (root / path).exists() else f"{path}: no such file or folder")
    for target in LINK_RE.findall(text):
        if "://" not in target:
            once(None if (root / "docs" / target).exists() else f"link {target}: no such file (relative to docs/)")
    for name in DOTTED_RE.findall(text):
        once(_dotted_problem(name, root))
    table = set(_stage_table_lines(text))  # its rows are checked as rows (below)
    prose = "\n".join(line for line in text.splitlines() if line not in table)
    for rel, qualname in QUALIFIED_RE.findall(prose) + POSSESSIVE_RE.findall(text):
        once(_symbol_problem(rel, qualname, root))
    for rel, listed in LISTED_RE.findall(text):
        for name in re.findall(r"`(\w+)`", listed):
            once(_symbol_problem(rel, name, root))
    for problem in _stage_table_problems(text, root):
        once(problem)
    return problems


@functools.cache
def _as_it_is() -> tuple[str, ...]:
    return tuple(doc_problems(DOC.read_text(encoding="utf-8")))


def new_problems(broken: str) -> list[str]:
    """What ``broken`` (the document edited) is reported for that the document as it is is not: a test of the checker
    holds whatever the document's own state."""
    return [p for p in doc_problems(broken) if p not in _as_it_is()]


# ---------------------------------------------------------------------------------------------------------------- tests
def test_the_architecture_doc_is_true_to_the_code():
    assert doc_problems(DOC.read_text(encoding="utf-8")) == []


def test_the_doc_names_what_the_checker_checks():
    """The checks are not vacuous: the document holds paths, dotted names, owned names and a full stage table."""
    text = DOC.read_text(encoding="utf-8")
    assert len(set(PATH_RE.findall(text))) > 50
    assert {"core.child.worker", "core.record.build.verdict", "tui.cli.cmd_plan"} <= set(DOTTED_RE.findall(text))
    assert ("core/pipeline.py", "run_pipeline") in POSSESSIVE_RE.findall(text)
    rows = stage_table(text)
    assert [(p, s) for p, s, _, _ in rows] == [
        *(("core/pipeline.py", s) for s in ("plan", "probe", "train_eval", "resume", "record")),
        *(("core/command/pipeline.py", s) for s in ("probe", "plan", "train_eval", "resume", "record"))]


def test_a_path_that_moved_is_reported(tmp_path):
    text = DOC.read_text(encoding="utf-8")
    assert "`core/stages/probe.py`" in text
    broken = tmp_path / "architecture.md"  # a copy of the document with one path renamed
    broken.write_text(text.replace("`core/stages/probe.py`", "`core/stages/probing.py`", 1), encoding="utf-8")
    problems = new_problems(broken.read_text(encoding="utf-8"))
    assert "core/stages/probing.py: no such file or folder" in problems
    problems = new_problems(text.replace("[plan.md](plan.md)", "[plan.md](planning.md)", 1))
    assert problems == ["link planning.md: no such file (relative to docs/)"]


def test_a_module_or_name_that_is_not_there_is_reported():
    text = DOC.read_text(encoding="utf-8")
    assert new_problems(text + "\n`core.stages.probing`, `core.record.build.verdicts`, `tui.cli.cmd_planning`\n") == [
        "core.stages.probing: module core.stages defines no 'probing'",
        "core.record.build.verdicts: module core.record.build defines no 'verdicts'",
        "tui.cli.cmd_planning: module tui.cli defines no 'cmd_planning'"]
    assert new_problems(text + "\n`core/record/build.py`'s `verdicts`; `core/pipeline.py` (`StagedRun`, `Staged`)\n") == [
        "core/record/build.py: defines no 'verdicts'", "core/pipeline.py: defines no 'Staged'"]


def test_a_stage_whose_owner_changed_in_the_doc_is_reported():
    text = DOC.read_text(encoding="utf-8")
    # the work of a stage named in a module that does not define it
    moved = text.replace("`core/stages/train.py::run_train_eval`", "`core/stages/probe.py::run_train_eval`")
    assert new_problems(moved) == ["stage table, core/pipeline.py train_eval: core/stages/probe.py: defines no "
                                   "'run_train_eval'"]
    # a function that exists but is not what the pipeline runs for the stage
    other = text.replace("`core/command/plan.py::plan_for`", "`core/plan/fit.py::plan_fits`")
    assert new_problems(other) == ["stage table, core/command/pipeline.py plan: core/command/pipeline.py does not "
                                   "import plan_fits from core.plan.fit"]
    # the events of one stage credited to another stage's method
    swapped = text.replace("| probe | `core/pipeline.py::AcceptanceRun.probe_stage` |",
                           "| probe | `core/pipeline.py::AcceptanceRun.train_eval_stage` |")
    assert new_problems(swapped) == ["stage table, core/pipeline.py probe: core/pipeline.py::AcceptanceRun."
                                     "train_eval_stage emits no StageStarted/StageFinished('probe') "
                                     "(it emits ['train_eval'])"]


def test_stage_rows_out_of_order_or_missing_are_reported():
    text = DOC.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| `core/command/pipeline.py` |")]
    probe, plan = rows[0], rows[1]
    reordered = text.replace(probe + "\n" + plan, plan + "\n" + probe)
    assert new_problems(reordered) == [
        "stage table: the rows of core/command/pipeline.py are ('plan', 'probe', 'train_eval', 'resume', 'record'), "
        "its STAGES ('probe', 'plan', 'train_eval', 'resume', 'record')"]
    assert new_problems(text.replace(STAGE_TABLE_HEADER, "| pipeline | stage | events | work |")) == [
        f"no stage table (a table headed {STAGE_TABLE_HEADER!r})"]


def test_code_that_moves_under_the_doc_is_reported(tmp_path):
    """The same document over a copy of the tree where a stage's function was renamed and a stage's events renamed:
    the checker reads the code, not only the document."""
    for entry in ROOT.iterdir():  # links to the tree; core/'s files linked one by one, the edited ones copied
        if entry.name not in ("core", ".git", ".venv", "runs"):
            (tmp_path / entry.name).symlink_to(entry)
    for source in (ROOT / "core").rglob("*.py"):
        (tmp_path / source.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / source.relative_to(ROOT)).symlink_to(source)
    for rel in ("core/stages/train.py", "core/command/pipeline.py"):
        (tmp_path / rel).unlink()
        shutil.copyfile(ROOT / rel, tmp_path / rel)
    text = DOC.read_text(encoding="utf-8")
    before = doc_problems(text, tmp_path)
    assert before == doc_problems(text)  # the copy is the tree
    train = tmp_path / "core" / "stages" / "train.py"
    train.write_text(train.read_text(encoding="utf-8").replace("def run_train_eval(", "def run_training("),
                     encoding="utf-8")
    pipeline = tmp_path / "core" / "command" / "pipeline.py"
    pipeline.write_text(pipeline.read_text(encoding="utf-8").replace('StageStarted("resume"', 'StageStarted("resumed"')
                        .replace('StageFinished("resume"', 'StageFinished("resumed"'), encoding="utf-8")
    (tmp_path / "core" / "quiz.py").unlink()
    assert [p for p in doc_problems(text, tmp_path) if p not in before] == [
        "core/quiz.py: no such file or folder",
        "stage table, core/pipeline.py train_eval: core/stages/train.py: defines no 'run_train_eval'",
        "stage table, core/command/pipeline.py resume: core/command/pipeline.py::CommandRun.resume_stage emits no "
        "StageStarted/StageFinished('resume') (it emits ['resumed'])"]


def unnamed_modules(text: str, root: Path = ROOT) -> list[str]:
    """The modules of core/ and tui/ (``__init__.py`` aside) that ``text`` names neither by path nor by dotted name."""
    out = []
    for path in sorted(p for package in ("core", "tui") for p in (root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if path.name != "__init__.py" and rel not in text and _dotted(rel) not in text:
            out.append(rel)
    return out


def test_the_doc_names_every_module():
    """Issue 53: docs/architecture.md names every module (a new one goes under "Every other module" at least)."""
    text = DOC.read_text(encoding="utf-8")
    assert unnamed_modules(text) == []
    assert unnamed_modules(text.replace("`core/gpus.py`", "")) == ["core/gpus.py"]
