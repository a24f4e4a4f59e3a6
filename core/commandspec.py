"""CommandSpec: the user's own training command to accept, and how gpuaccept runs, kills, resumes and evaluates it.

A spec file holds command mode in a ``[command]`` table (every key but ``train`` optional)::

    [command]
    train = "torchrun --nproc-per-node 2 train.py --output_dir {out} --data {train_data}"
    resume = "{command} --resume_from_checkpoint {checkpoint}"   # the default
    checkpoints = "checkpoint-*"    # a glob inside {out}: the folders (or files) the command's checkpoints are
    metrics = "auto"                # auto: what the Trainer hook reports (else trainer_state.json); or a JSON-lines
                                    # file inside {out} with step, loss (and learning_rate, sample_ids); or a CSV
                                    # file with a header row holding step and loss (Lightning's CSVLogger, LitGPT)
    checkpoint_files = []           # what a checkpoint must hold; default: Trainer's set when a Trainer ran
    workdir = "."                   # where the command runs
    model = ""                      # the base model folder (or "smollm2-135m", the embedded one): the tokenizer, the
                                    # evaluation before training; {model}
    data = "embedded"               # gpuaccept's text: {train_data} gets its training split, the evaluation its
    heldout_fraction = 0.2          #   held-out split
    eval = "perplexity"             # perplexity | none | a command with {checkpoint} printing a JSON metric
    config = "auto"                 # the trainer's YAML config to plan from when no Trainer reports what ran: auto
                                    # (a .yml/.yaml file the command names), none, or its path
    eval_seq_len = 0                # 0: the sequence length the Trainer ran (else 128)
    eval_max_blocks = 32
    kill_after_checkpoint = 1       # SIGKILL after the command's 1st checkpoint, before its 2nd
    resume_check = true
    resume_noise = "auto"           # auto | twin | off: how the run-to-run noise bounding the comparison is known
                                    # (auto: twin runs of the command on CUDA; bit-exact on the CPU)
    resume_twins = 2                # twin runs measuring the noise (at least 2; all but the first nudged by one ulp)
    dtype = "fp32"                  # the compute dtype, for the resume check's tier when no Trainer reports it
    timeout_s = 0                   # 0: no limit on one run of the command

    [command.env]                   # variables added to the command's environment
    WANDB_MODE = "offline"

Placeholders, replaced in each word of the command (never through a shell): ``{out}`` (the run's own output folder:
every run of the command gets a fresh one, so the three runs never share checkpoints; required in ``train``),
``{checkpoint}`` (the checkpoint to resume from; required in ``resume``), ``{command}`` (in ``resume`` only, alone as a
word: the training command's words), ``{train_data}`` (a text file of gpuaccept's training split, documents separated by
blank lines), ``{train_data_dir}`` (the folder holding that file alone: a dataset folder for ``datasets.load_dataset``,
as TRL's ``--dataset_name`` takes it), ``{model}`` (``model``) and, in an evaluation command, ``{heldout_data}`` (a text
file of gpuaccept's held-out split, the documents the perplexity evaluation reads).

Every invalid value raises :class:`~core.errors.SpecError` naming the field and what to change.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import shutil
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.bounds import check_path, loads_bounded, read_input_text, special_file_kind
from core.dtypes import DTYPES
from core.errors import SpecError
from core.settings import KIND_WORDS, setting, settings_of, value_fits
from core.spec import EMBEDDED_DATA, EMBEDDED_MODEL, YAML_SUFFIXES, canonical_sha256
from core.specparse import MAX_STEPS
from core.spectables import COMMAND_TWINS, MAX_TWINS

#: The placeholders a command may hold, with what replaces them.
PLACEHOLDERS = {
    "{out}": "the run's own output folder (fresh for each run of the command)",
    "{checkpoint}": "the checkpoint to resume from (resume command only)",
    "{command}": "the training command's words (resume command only, alone as a word)",
    "{train_data}": "a text file of gpuaccept's training split (documents separated by blank lines)",
    "{train_data_dir}": "the folder holding {train_data} alone: a dataset folder (datasets.load_dataset reads it as "
                        "text with a train split; TRL's --dataset_name)",
    "{model}": "the base model folder given as model",
    "{heldout_data}": "a text file of gpuaccept's held-out split (evaluation command only; documents separated by "
                      "blank lines)",
}
#: Words a shell would read as operators: the command runs without a shell, so they would reach the program as text.
SHELL_OPERATORS = ("&&", "||", "|", ";", ">", ">>", "<", "2>", "2>&1", "&")
#: The default resume command: Trainer's flag, as transformers' example scripts and TRL's take it.
DEFAULT_RESUME = "{command} --resume_from_checkpoint {checkpoint}"
EVAL_CHOICES = ("perplexity", "none")


@dataclass(frozen=True)
class CommandSpec:
    """The user's command to accept (see the module docstring for each field)."""

    # Each field is declared once, here (core/settings.py): its flag (or the recipe's flag of the same meaning, whose
    # command_key names it: cli=False), its type check (SETTING_TYPES), and its field on the wizard's form (label)
    train: str = setting(
        flag="--command", metavar="COMMAND", label="Training command", form_order=10,
        placeholder="python train.py --output_dir {out}",
        help="the training command, e.g. \"torchrun --nproc-per-node 2 train.py --output_dir {out}\" (run without a "
             "shell; {out} where it takes its output folder: each run gets its own; or a trainer's config file whose "
             "output key gpuaccept sets per run)")
    resume: str = setting(DEFAULT_RESUME, flag="--resume-command", metavar="COMMAND", label="Resume command",
                          form_order=20, help=f"how it resumes (default: \"{DEFAULT_RESUME}\")")
    checkpoints: str = setting("checkpoint-*", flag="--checkpoints", metavar="GLOB", label="Checkpoints in {out}",
                               form_order=30, help="the checkpoint folders inside {out} (default checkpoint-*)")
    metrics: str = setting("auto", flag="--metrics", metavar="FILE", label="Metrics", form_order=40,
                           placeholder="auto, or a JSON-lines or CSV file in {out}",
                           help="auto (the Trainer hook, else trainer_state.json; default), or a JSON-lines file inside "
                                "{out} with step, loss (learning_rate, sample_ids), or a CSV file with a header row "
                                "holding step and loss (Lightning's CSVLogger: logs/csv/version_0/metrics.csv)")
    checkpoint_files: tuple[str, ...] = setting(
        (), flag="--checkpoint-files", metavar="A,B", label="Checkpoint files", form_order=50,
        placeholder="Trainer's set if a Trainer runs; else a,b,c",
        help="the files a checkpoint must hold (default: Trainer's set when a Trainer ran)")
    workdir: str = setting(".", flag="--workdir", metavar="DIR", label="Working folder", form_order=60,
                           help="where the command runs (default: here)")
    env: dict[str, str] = setting(default_factory=dict, flag="--env", metavar="KEY=VALUE",
                                  help="a variable added to the command's environment (repeat the flag for more)")
    model: str = setting("", cli=False, label="Base model folder", form_order=70,
                         placeholder="for {model}, the tokenizer, the base's score",
                         help="the base model folder (or smollm2-135m): the tokenizer, the evaluation before "
                              "training; {model} (--model)")
    data: str = setting(EMBEDDED_DATA, cli=False, label="Data", form_order=80,
                        help="gpuaccept's text: {train_data} gets its training split, the evaluation its held-out "
                             "split (--data)")
    heldout_fraction: float = setting(0.2, cli=False, help="the held-out share of the data (--heldout-fraction)")
    eval: str = setting("perplexity", flag="--eval", metavar="HOW", label="Evaluation", form_order=90,
                        placeholder="perplexity, none, or a command with {checkpoint}",
                        help="perplexity (default: held-out perplexity of the final checkpoint vs its base), none, or "
                             "an evaluation command with {checkpoint} printing a JSON line {\"metric\", \"value\"}")
    config: str = setting("auto", flag="--trainer-config", metavar="FILE",
                          help="the trainer's YAML config to plan from when the command reports no Trainer: auto (the "
                               "first .yml/.yaml file the training command names, read by an importer; default), "
                               "none, or its path")
    eval_seq_len: int = setting(0, flag="--eval-seq-len", metavar="N",
                                help="tokens per held-out block (default: the Trainer's widest batch, else 128)")
    eval_max_blocks: int = setting(32, cli=False, help="held-out blocks evaluated, at most (--eval-max-blocks)")
    kill_after_checkpoint: int = setting(1, cli=False, label="Kill after ckpt #", form_order=100,
                                         help="SIGKILL after the command's checkpoint of this number, before the "
                                              "next (--kill-after-checkpoint)")
    resume_check: bool = setting(True, cli=False, help="run the kill-and-resume check (--resume-check)")
    resume_noise: str = setting("auto", cli=False,
                                help="auto | twin | off: how the run-to-run noise bounding the comparison is known "
                                     "(--resume-noise)")
    resume_twins: int = setting(COMMAND_TWINS, cli=False,
                                help="how many twin runs of the command measure the noise (at least 2; the second is "
                                     "nudged by one ulp) (--resume-twins)")
    dtype: str = setting("fp32", cli=False,
                         help="the compute dtype, for the resume check's tier when no Trainer reports it (--dtype)")
    timeout_s: float = setting(0.0, flag="--timeout", metavar="S",
                               help="the longest one run of the command may take (default: no limit)")
    nnodes: int = setting(1, cli=False, help="nodes your launcher line runs on (--nnodes): above 1, run gpuaccept with "
                                             "the same command on every node; the nodes stop together and the node "
                                             "holding rank 0 writes the cluster record")
    rdzv_endpoint: str = setting("", cli=False, help="host:port of your launcher's rendezvous (--rdzv-endpoint; "
                                                     "nnodes > 1): the nodes' gpuaccept agree on port + 1 of that host")
    rdzv_id: str = setting("gpuaccept", cli=False, help="the job id every node's gpuaccept shares (--rdzv-id)")

    # ------------------------------------------------------------------ what the pipeline and the screens read
    mode = "command"

    @property
    def training(self) -> bool:
        return True

    @property
    def label(self) -> str:
        """The command's program and first script, for a run folder's name and a screen's title."""
        words = self.words()
        script = next((w for w in words[1:] if w.endswith((".py", ".sh", ".yaml", ".yml", ".json", ".toml"))), "")
        return Path(script).name if script else Path(words[0]).name

    def words(self) -> list[str]:
        """The training command split into words as a POSIX shell would (``shlex``), placeholders not replaced."""
        return shlex.split(self.train)

    def resume_words(self) -> list[str]:
        """The resume command's words with ``{command}`` spliced in (placeholders otherwise not replaced)."""
        out: list[str] = []
        for word in shlex.split(self.resume):
            out.extend(self.words() if word == "{command}" else [word])
        return out

    def uses(self, placeholder: str) -> bool:
        """The training or resume command holds ``placeholder`` (``"{train_data}"``)."""
        return any(placeholder in w for w in self.words() + self.resume_words())

    def uses_training_split(self) -> bool:
        """The command trains on gpuaccept's training split: it holds ``{train_data}`` or ``{train_data_dir}``."""
        return self.uses("{train_data}") or self.uses("{train_data_dir}")

    def uses_heldout_split(self) -> bool:
        """The evaluation command reads gpuaccept's held-out split: it holds ``{heldout_data}``."""
        return self.eval not in EVAL_CHOICES and "{heldout_data}" in self.eval

    @property
    def workdir_path(self) -> Path:
        return Path(self.workdir).expanduser().resolve()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> CommandSpec:
        """The ``[command]`` table of a TOML spec file, with ``overrides`` (flags; None is ignored) over it.

        Raises:
            SpecError: the file cannot be read, has no ``[command]`` table, or holds settings of gpuaccept's own recipe
                beside it; any invalid value (:meth:`validate`).
        """
        raw = read_command_table(Path(path))
        return cls.from_dict({**raw, **{k: v for k, v in overrides.items() if v is not None}})

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> CommandSpec:
        """Build and validate a spec from the ``[command]`` table's mapping.

        Raises:
            SpecError: an unknown key, a value of the wrong type, or an invalid value, naming it.
        """
        raw = dict(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        for key in raw:
            if key not in known:
                raise SpecError(f"command.{key}", f"unknown setting of [command]; known: {', '.join(sorted(known))}")
        if "train" not in raw or not str(raw.get("train") or "").strip():
            raise SpecError("command.train", "the training command is missing: give it as --command \"...\" or "
                                             "train = \"...\" in the [command] table")
        _check_types(raw)
        if "checkpoint_files" in raw:
            raw["checkpoint_files"] = tuple(raw["checkpoint_files"])
        if "env" in raw:
            raw["env"] = {str(k): str(v) for k, v in raw["env"].items()}
        spec = cls(**raw)
        spec.validate()
        return spec

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every value that can be checked before the command runs: both commands parse, hold their required
        placeholders and no shell operator, their program is found, the folders and files named exist.

        Raises:
            SpecError: naming the first invalid field and what to change.
        """
        words = _split("command.train", self.train)
        if not words:
            raise SpecError("command.train", "the training command is empty")
        _no_shell("command.train", self.train)
        if any("{checkpoint}" in w or "{command}" in w for w in words):
            raise SpecError("command.train", "{checkpoint} and {command} belong in the resume command, not the "
                                             "training command")
        resume = _split("command.resume", self.resume)
        _no_shell("command.resume", self.resume)
        if any("{heldout_data}" in w for w in words + resume):
            raise SpecError("command.train", "{heldout_data} is the held-out split: only the evaluation command "
                                             "reads it (a run that trains on it makes the evaluation meaningless)")
        if any("{command}" in w and w != "{command}" for w in resume):
            raise SpecError("command.resume", "{command} stands alone as a word (it is replaced by the training "
                                              "command's words), e.g. \"{command} --resume {checkpoint}\"")
        if not any("{checkpoint}" in w for w in resume):
            raise SpecError("command.resume", "the resume command must say where the checkpoint goes: put "
                                              "{checkpoint} in it, e.g. \"{command} --resume_from_checkpoint "
                                              "{checkpoint}\"")
        out_given = any("{out}" in w for w in words)
        if out_given and not any("{out}" in w for w in self.resume_words()):
            raise SpecError("command.resume", "the resumed run must write into its own folder too: put {out} (or "
                                              "{command}, which holds it) in the resume command")
        if not out_given and "{command}" not in resume:
            raise SpecError("command.resume", "the training command takes its output folder from its config file: "
                                              "start the resume command with {command} (which names that file), "
                                              "e.g. \"{command} --resume {checkpoint}\"")
        check_path("command.workdir", self.workdir)  # before any stat (core/bounds.py)
        if not self.workdir_path.is_dir():
            raise SpecError("command.workdir", f"{self.workdir} is not a folder; give the folder the command runs in")
        if not out_given:  # the output folder is the config file's key (the run writes a copy per run)
            from core.command.configfile import out_config

            out_config(words, self.config, self.workdir_path)
        program = words[0]
        if "{" not in program and find_program(program, self.workdir_path, self.env) is None:
            raise SpecError("command.train", f"{program}: not found (on PATH, or as a file in {self.workdir_path}); "
                                             "give the program's path")
        self._check_paths()
        self._check_numbers()

    def _check_paths(self) -> None:
        pattern = self.checkpoints
        if not pattern or Path(pattern).is_absolute() or ".." in Path(pattern).parts or "{" in pattern:
            raise SpecError("command.checkpoints", f"{pattern!r}: give a glob inside the run's output folder {{out}}, "
                                                   "such as \"checkpoint-*\" (no absolute path, no ..)")
        if self.metrics != "auto" and (Path(self.metrics).is_absolute() or ".." in Path(self.metrics).parts):
            raise SpecError("command.metrics", f"{self.metrics!r}: give \"auto\" or a file inside the run's output "
                                               "folder {out}, such as \"metrics.jsonl\"")
        for name in self.checkpoint_files:
            if not name or Path(name).is_absolute() or ".." in Path(name).parts:
                raise SpecError("command.checkpoint_files", f"{name!r}: name files by their path inside a checkpoint")
        if self.uses("{model}") and not self.model:
            raise SpecError("command.model", "the command holds {model}: give the base model folder as model")
        check_path("command.model", self.model)
        if self.model and self.model != EMBEDDED_MODEL and not Path(self.model).expanduser().is_dir():
            raise SpecError("command.model", f"{self.model} is not a folder; give the base model's Hugging Face "
                                             f"folder (its tokenizer and weights), {EMBEDDED_MODEL} (the embedded "
                                             "model), or leave model empty")
        if self.data != EMBEDDED_DATA:
            check_path("command.data", self.data)
            path = Path(self.data)
            kind = special_file_kind(path)  # os.stat only: a FIFO is never opened
            if kind is not None:
                raise SpecError("command.data", f"{self.data} is {kind}, not a file; give 'embedded' or a .txt / "
                                                ".jsonl file")
            if path.suffix not in (".txt", ".jsonl") or not path.is_file():
                raise SpecError("command.data", f"{self.data!r}: give 'embedded' or an existing .txt / .jsonl file")
        if self.eval not in EVAL_CHOICES:
            words = _split("command.eval", self.eval)
            _no_shell("command.eval", self.eval)
            if not any("{checkpoint}" in w for w in words):
                raise SpecError("command.eval", "an evaluation command takes the checkpoint to evaluate: put "
                                                "{checkpoint} in it, or choose perplexity or none")

    def _check_numbers(self) -> None:
        if not 0.0 < self.heldout_fraction < 1.0:
            raise SpecError("command.heldout_fraction", f"must be between 0 and 1, exclusive (got "
                                                        f"{self.heldout_fraction})")
        if self.config not in ("auto", "none"):
            path = self.workdir_path / Path(self.config).expanduser()
            if path.suffix.lower() not in YAML_SUFFIXES or not path.is_file():
                raise SpecError("command.config", f"{self.config!r}: give auto, none, or an existing .yml / .yaml file "
                                                  "(the trainer's config)")
        if not 0 <= self.eval_seq_len <= 1_000_000 or self.eval_seq_len == 1:
            raise SpecError("command.eval_seq_len", f"0 (the Trainer's) or at least 2 tokens (got {self.eval_seq_len})")
        if not 1 <= self.eval_max_blocks <= MAX_STEPS:
            raise SpecError("command.eval_max_blocks", f"must be at least 1 (got {self.eval_max_blocks})")
        if not 1 <= self.kill_after_checkpoint <= MAX_STEPS:
            raise SpecError("command.kill_after_checkpoint", "must be at least 1: the kill comes after that "
                                                             f"checkpoint of the command (got {self.kill_after_checkpoint})")
        if self.resume_noise not in ("auto", "twin", "off"):
            raise SpecError("command.resume_noise", f"{self.resume_noise!r}: choose auto (a twin run of the command "
                                                    "measures the noise on CUDA), twin (always) or off (bit-exact)")
        if not 2 <= self.resume_twins <= MAX_TWINS:
            raise SpecError("command.resume_twins", f"{self.resume_twins}: give 2 to {MAX_TWINS} twin runs (two at "
                                                    "least: their spread is the noise)")
        if self.dtype not in DTYPES:
            raise SpecError("command.dtype", f"{self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.timeout_s < 0:
            raise SpecError("command.timeout_s", f"must be 0 (no limit) or a number of seconds (got {self.timeout_s})")
        self._check_nodes()

    def _check_nodes(self) -> None:
        """Several nodes: an endpoint for the nodes' agreement, the launcher line's own node count the same, and no
        resume check (not built across nodes for a user's command)."""
        launched = launcher_nnodes(self.words())
        if launched is not None and launched != self.nnodes:
            runs = f"on {launched} nodes (--nnodes {launched})" if launched > 1 else "on one node (torchrun's default)"
            raise SpecError("command.nnodes", f"your launcher line runs {runs} and gpuaccept was told {self.nnodes}: "
                                              f"give your torchrun and gpuaccept the same --nnodes (with "
                                              "--rdzv-endpoint HOST:PORT) on every node")
        if self.nnodes < 1:
            raise SpecError("command.nnodes", f"must be at least 1 (got {self.nnodes})")
        if self.nnodes == 1:
            return
        host, sep, port = self.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise SpecError("command.rdzv_endpoint", f"{self.rdzv_endpoint!r}: several nodes need the rendezvous "
                                                     "host:port every node reaches (the one your launcher line "
                                                     "names); gpuaccept's nodes agree on its port + 1")

    # ------------------------------------------------------------------ the record
    def to_dict(self) -> dict[str, Any]:
        """The spec as the record's ``spec`` table holds it (``mode = "command"`` and the ``[command]`` table)."""
        data = dataclasses.asdict(self)
        data["checkpoint_files"] = list(self.checkpoint_files)
        return {"mode": "command", "command": data}

    def spec_hash(self) -> str:
        """sha256 of the canonical JSON of :meth:`to_dict` (what ``gpuaccept verify`` recomputes)."""
        return canonical_sha256(self.to_dict())


#: the programs that are torchrun: its console script, or the module run with ``python -m``
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def launcher_nnodes(words: list[str]) -> int | None:
    """The node count a torchrun launcher line asks for (``--nnodes N``, ``--nnodes=N`` before the script; ``MIN:MAX``
    gives MAX; none given: torchrun's default, 1), or None when the line is no torchrun or its value is no number."""
    found = _launcher_option(words, ("--nnodes",))
    if found is None:
        return None
    _, value = found
    if value is None:
        return 1
    last = value.rsplit(":", 1)[-1]
    return int(last) if last.isdigit() else None


def launcher_nproc(words: list[str]) -> int | None:
    """The processes per node a torchrun launcher line starts (``--nproc-per-node N`` / ``--nproc_per_node``, ``=``
    forms too; none given: torchrun's default, 1), or None when the line is no torchrun or the value is no number
    (``gpu``, ``auto``: as many as the node has, which only the node knows)."""
    found = _launcher_option(words, NPROC_FLAGS)
    if found is None:
        return None
    _, value = found
    return 1 if value is None else (int(value) if value.isdigit() else None)


def launcher_world(words: list[str]) -> int | None:
    """The world size a torchrun launcher line runs at: nodes x processes per node (None: no torchrun, or a value
    only the node knows)."""
    nodes, procs = launcher_nnodes(words), launcher_nproc(words)
    return None if nodes is None or procs is None else nodes * procs


def with_nproc(words: list[str], nproc: int) -> list[str]:
    """The torchrun launcher line ``words`` starting ``nproc`` processes per node: its ``--nproc-per-node`` value
    replaced, or the flag added after the launcher when it had none.

    Raises:
        ValueError: ``words`` is no torchrun line."""
    found = _launcher_option(words, NPROC_FLAGS)
    if found is None:
        raise ValueError("not a torchrun launcher line")
    i, value = found
    out = list(words)
    if value is None:
        out.insert(i, f"--nproc-per-node={nproc}")
    elif "=" in out[i]:
        out[i] = f"{out[i].split('=', 1)[0]}={nproc}"
    else:
        out[i + 1] = str(nproc)
    return out


#: torchrun's spellings of its processes-per-node flag
NPROC_FLAGS = ("--nproc-per-node", "--nproc_per_node")


def _launcher_option(words: list[str], names: tuple[str, ...]) -> tuple[int, str | None] | None:
    """Where a torchrun line sets the option ``names`` (before its script) and its value: (index of the flag, value);
    (index where the launcher's options end, None) when it does not; None when the line is no torchrun."""
    is_torchrun = bool(words) and (Path(words[0]).name == "torchrun" or any(
        a == "-m" and b in TORCHRUN_MODULES for a, b in zip(words, words[1:])))
    if not is_torchrun:
        return None
    start = 1 if Path(words[0]).name == "torchrun" else words.index("-m") + 2
    for i in range(start, len(words)):
        word = words[i]
        if word.endswith(".py") or word == "-m":  # the script and its own arguments: not torchrun's
            return start, None
        flag = word.split("=", 1)[0]
        if flag in names:
            value = word.split("=", 1)[1] if "=" in word else (words[i + 1] if i + 1 < len(words) else None)
            return i, value
    return start, None


def substitute(words: list[str], values: Mapping[str, str]) -> list[str]:
    """Each word with every placeholder of ``values`` (``{"{out}": "/runs/x/out"}``) replaced; the words are never
    joined or re-split, so a path with spaces stays one argument."""
    out = []
    for word in words:
        for key, value in values.items():
            word = word.replace(key, value)
        out.append(word)
    return out


def find_program(program: str, workdir: Path, env: Mapping[str, str] | None = None) -> str | None:
    """The executable ``program`` names: a path (relative to ``workdir``) when it holds a ``/``, else the first match
    on ``PATH`` (the command's environment's, with ``env`` over this process's)."""
    if "/" in program:
        path = (workdir / program).expanduser()
        return str(path.absolute()) if path.is_file() and os.access(path, os.X_OK) else None
    search = (env or {}).get("PATH", os.environ.get("PATH", ""))
    return shutil.which(program, path=search)


def read_command_table(path: Path) -> dict[str, Any]:
    """The ``[command]`` table of the TOML file ``path``.

    Raises:
        SpecError: the file is missing or not TOML, has no ``[command]`` table, or holds other settings beside it.
    """
    try:
        raw = loads_bounded(read_input_text(path, "a TOML spec"))  # nesting and strings bounded (core/bounds.py)
    except FileNotFoundError:
        raise SpecError("spec", f"file {path} not found; give the path of a TOML spec") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("spec", f"{path} cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError("spec", f"{path} is not valid TOML ({exc}); fix the file") from None
    table = raw.get("command")
    if not isinstance(table, dict):
        raise SpecError("command", f"{path} has no [command] table")
    others = sorted(set(raw) - {"command", "accept"})  # [accept]: the criteria (read_command_criteria)
    if others:
        raise SpecError(others[0], f"{path}: command mode takes its settings in the [command] table alone; "
                                   f"{', '.join(others)} belong to gpuaccept's own recipe: move what applies into "
                                   "[command] (data, heldout_fraction, eval_max_blocks, kill_after_checkpoint, ...)")
    return dict(table)


def read_command_criteria(path: Path) -> dict[str, Any]:
    """The ``[accept]`` table beside a spec file's ``[command]`` table (empty when there is none): the criteria
    (core/criteria.py ``command_criteria`` checks which apply to a command).

    Raises:
        SpecError: the file cannot be read, or ``accept`` is not a table.
    """
    read_command_table(path)  # the file's own errors, named
    table = loads_bounded(read_input_text(path, "a TOML spec")).get("accept", {})
    if not isinstance(table, dict):
        raise SpecError("accept", f"{path}: accept is {type(table).__name__}, not a table of criteria")
    return dict(table)


def is_command_file(path: str | Path) -> bool:
    """The TOML file ``path`` holds a ``[command]`` table (command mode), read without validating it."""
    try:
        return isinstance(loads_bounded(read_input_text(path, "a TOML spec")).get("command"), dict)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False


def _split(name: str, text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise SpecError(name, f"cannot be split into words ({exc}): close the quote") from None


def unquoted_words(text: str) -> list[str]:
    """The words of ``text`` with their quotes kept (``"a '|' b"`` -> ``["a", "'|'", "b"]``): a quoted ``'|'`` is an
    argument (``--sep '|'``), an unquoted one a shell operator."""
    lexer = shlex.shlex(text, posix=False)
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:
        return []


def _no_shell(name: str, text: str) -> None:
    ops = [w for w in unquoted_words(text) if w in SHELL_OPERATORS]
    if ops:
        raise SpecError(name, f"{ops[0]!r}: the command runs without a shell, so shell operators reach the program as "
                              "words; put a pipeline or redirection in a script and give the script")


#: the flags' argument group in ``gpuaccept run --help``
FLAGS_GROUP = ("your own command (command mode: accept your training command as you run it; or a [command] table in "
               "the spec file; placeholders {out} {checkpoint} {command} {train_data} {train_data_dir} {model} "
               "{heldout_data}, see "
               "docs/command-mode.md)")
#: every setting of the [command] table, made from the declarations on :class:`CommandSpec` (core/settings.py): keys
#: ``command.train``, dests ``command_train``
COMMAND_SETTINGS = settings_of(CommandSpec, table="command", cli_group=FLAGS_GROUP)
#: each key's type in the [command] table: (test, words); the spec checks a TOML file by it, verify a record's
#: [spec.command] table (core/record/command.py)
SETTING_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    s.name: (functools.partial(value_fits, s.kind), KIND_WORDS[s.kind]) for s in COMMAND_SETTINGS}


def _check_types(raw: Mapping[str, Any]) -> None:
    for key, value in raw.items():
        test, words = SETTING_TYPES[key]
        if not test(value):
            raise SpecError(f"command.{key}", f"{value!r} is not {words}")
