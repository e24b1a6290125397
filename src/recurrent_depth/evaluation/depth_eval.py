"""`rdepth eval` as a function: quality against test-time depth, with a non-recurrent baseline beside it.

    results = evaluate_depths(EvalConfig(model="runs/quickstart/model", depths=[1, 2, 4, 8, 16, 32]))

Three kinds of measurement, each at every depth in `depths`:

1. held-out text: loss, perplexity, bits per byte (`quality.text_quality`), default the
   embedded corpus's validation documents;
2. reasoning tasks generated in code (`reasoning_tasks`, e.g. ``chains``): exact-match accuracy
   per difficulty (`reasoning.accuracy_grid`);
3. any lm-eval task (`lm_eval_tasks`: the shipped offline ``rd_*`` ones, lm-eval's own, and the user's in
   `lm_eval_include_path` folders), through the ``recurrent-depth`` backend, optionally for several few-shot
   counts (the paper's figure 9).

A baseline model (`baseline`, e.g. a non-recurrent twin trained at fixed depth 1) is evaluated
once, at its own depth, and drawn as a horizontal line. Writes `results.json` and PNG figures.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from recurrent_depth.config import MAX_NUM_STEPS
from recurrent_depth.data.tokenizer import tokenizer_directory
from recurrent_depth.evaluation.quality import check_scoring_window
from recurrent_depth.evaluation.readout import check_depths
from recurrent_depth.files import atomic_write_text, check_out_dir, finite_or_null
from recurrent_depth.weight_quant import check_weights, quantize_weights


@dataclass
class EvalConfig:
    model: str
    depths: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    out: str = "runs/eval"
    data: str | None = "stdlib"  # None: skip the text measurement
    text_field: str = "text"  # the field / column of a record's text (JSONL, Parquet, saved dataset), as in training
    val_fraction: float = 0.02
    split_seed: int = 0
    max_docs: int = 32
    max_tokens: int = 20_000
    seq_len: int | None = None
    reasoning_tasks: list[str] = field(default_factory=list)
    difficulties: list[int] | None = None
    count: int = 100
    lm_eval_tasks: list[str] = field(default_factory=list)
    # folders of the user's own lm-eval task YAML files, indexed beside the shipped rd_* ones (an entry may be "a:b")
    lm_eval_include_path: list[str] = field(default_factory=list)
    fewshot: list[int] = field(default_factory=lambda: [0])
    limit: int | None = None
    baseline: str | None = None
    baseline_depth: int | None = None
    init_scale: float | None = None
    seed: int = 0
    batch_size: int = 8
    device: str = "cpu"
    dtype: str | None = None
    tokenizer: str | None = None  # the model's tokenizer directory; None: the one inside `model`
    weights: str | None = None  # "int8" / "int4" / "int4:g<group>": weight-only quantization at load (weight_quant.py)
    max_depth: int | None = None  # the depth ceiling (None: MAX_NUM_STEPS); the baseline's default depth keeps it too
    lora: str | None = None  # a peft LoRA adapter directory applied to `model` (not the baseline), unmerged
    strict_lora_base: bool = False  # refuse the adapter when `model` is not the base it records (default: warn)

    def validate(self) -> EvalConfig:
        check_weights(self.weights)
        if self.strict_lora_base and self.lora is None:
            raise ValueError("strict_lora_base checks the base of a lora adapter, and none is given")
        self.depths = check_depths(self.depths, "depths")
        for name in ("max_docs", "max_tokens", "count", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")
        if not 0 < self.val_fraction <= 1:
            raise ValueError(f"val_fraction={self.val_fraction!r} is invalid: expected a number in (0, 1] "
                             f"(1 scores every document)")
        limit = self.limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            # lm-eval's own words for these: "did not find any docs!", "Indices for islice() must be ..."
            raise ValueError(f"limit={self.limit!r} is invalid: expected an integer >= 1 (examples per task)")
        if not self.fewshot or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in self.fewshot):
            raise ValueError(f"fewshot={self.fewshot!r} is invalid: expected a list of integers >= 0")
        # (inf or nan reached trunc_normal_ after the text was scored: a traceback, "from is out of bounds")
        if self.init_scale is not None and not (math.isfinite(self.init_scale) and self.init_scale >= 0):
            raise ValueError(f"init_scale={self.init_scale!r} is invalid: expected a finite number >= 0")
        if self.tokenizer is not None:  # --tokenizer takes the file too; transformers loads a directory
            self.tokenizer = tokenizer_directory(self.tokenizer)
        check_scoring_window(self.seq_len)  # before any model loads
        # options that only one measurement reads: given without it, they were silently ignored
        for name, needs, what in (("baseline_depth", "baseline", "--baseline"),
                                  ("difficulties", "reasoning_tasks", "--reasoning"),
                                  ("limit", "lm_eval_tasks", "--lm-eval-tasks"),
                                  ("lm_eval_include_path", "lm_eval_tasks", "--lm-eval-tasks")):
            if getattr(self, name) not in (None, []) and not getattr(self, needs):
                raise ValueError(f"{name}={getattr(self, name)!r} applies to {needs} ({what}), and none is given")
        self.lm_eval_include_path = include_dirs(self.lm_eval_include_path)
        if self.baseline_depth is not None:  # checked here, not after the model's own scoring
            check_depths([self.baseline_depth], "baseline_depth")
        from recurrent_depth.evaluation.reasoning.tasks import TASKS, get_task

        unknown = [name for name in self.reasoning_tasks if name not in TASKS]
        if unknown:  # checked here, not after the text scoring (whose results were then lost)
            raise ValueError(f"unknown reasoning task(s) {unknown}; choose from {sorted(TASKS)}")
        for name in self.reasoning_tasks:  # likewise a difficulty out of a task's range
            for difficulty in self.difficulties or []:
                get_task(name).check_difficulty(difficulty)
        if self.data is None and not self.reasoning_tasks and not self.lm_eval_tasks:
            raise ValueError("nothing to evaluate: give data (--data), reasoning_tasks (--reasoning) or lm_eval_tasks "
                             "(--lm-eval-tasks)")
        return self


def include_dirs(value: Any, name: str = "lm_eval_include_path (--lm-eval-include-path)") -> list[str]:
    """The include path as a list of existing directories; a ValueError naming the first that is not one (lm-eval
    skips it silently, and its tasks were then only "unknown"). `name`: the setting's, for the message (`rdepth
    lm-eval` checks its --include_path here too)."""
    from recurrent_depth.evaluation.lm_eval_env import include_path_list

    paths = include_path_list(value)
    for path in paths:
        if not Path(path).is_dir():
            what = "is a file, not a directory" if Path(path).exists() else "does not exist"
            raise ValueError(f"{name} {path!r} {what}: expected a folder of lm-eval task YAML files")
    return paths


def _load(path: str, device: str, dtype: str | None, tokenizer_dir: str | None = None,
          weights: str | None = None):
    from transformers import AutoTokenizer

    from recurrent_depth.model.recurrent import RecurrentDepthLM

    model = RecurrentDepthLM.from_pretrained(path, dtype=dtype, device=device, weights=weights)
    source = Path(tokenizer_dir if tokenizer_dir is not None else path)
    if tokenizer_dir is not None and not (source / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--tokenizer {tokenizer_dir}: no tokenizer.json in that directory")
    tokenizer = AutoTokenizer.from_pretrained(str(source)) if (source / "tokenizer.json").is_file() else None
    return model, tokenizer


def _with_adapter(model: Any, config: EvalConfig) -> Any:
    """`model` (loaded from config.model) with config.lora on its layers, unmerged, checked as `rdepth generate
    --lora` checks it (files, targets, base fingerprint); `model` as it is without one."""
    if config.lora is None:
        return model
    from recurrent_depth.train.lora import attach_adapter

    return attach_adapter(model, config.lora, strict_base=config.strict_lora_base, model_dir=config.model)


def _documents(config: EvalConfig):
    from recurrent_depth.data.corpus import DocumentSplit, load_corpus

    corpus = load_corpus(config.data, config.text_field)
    if config.val_fraction >= 1:  # no split: score the data whole (the first max_docs documents)
        for doc in itertools.islice(corpus, config.max_docs):
            yield doc.text
        return
    split = DocumentSplit.plan(corpus.ids(), config.val_fraction, seed=config.split_seed)
    held_out = 0
    for doc in itertools.islice(split.select(corpus, "validation"), config.max_docs):
        held_out += 1
        yield doc.text
    if held_out == 0:  # e.g. one document: the split keeps it for training (quality.py's error would not say so)
        count = sum(1 for _ in corpus.ids())
        raise ValueError(f"no held-out text: --data {config.data!r} holds {count} document(s) and --val-fraction "
                         f"{config.val_fraction:g} held out none of them; give more documents, or --val-fraction 1 "
                         f"to score them all")


def _text_quality(
    model, tokenizer, config: EvalConfig, depths: list[int], max_bytes: int | None = None, source: str | None = None
) -> dict[str, Any]:
    """Bits per byte etc. on the held-out text: the first `--max-tokens` tokens of it, or (a baseline,
    whose tokenizer may differ) exactly the first `max_bytes` bytes the model was scored on. source: the
    model as errors name it (default config.model)."""
    from recurrent_depth.evaluation.quality import PlainTokenizer, text_quality

    bos, pad = _text_ids(model, tokenizer, config.model if source is None else source)
    result = text_quality(
        model, _documents(config), PlainTokenizer(tokenizer), depths, bos, pad, seq_len=config.seq_len,
        max_tokens=config.max_tokens if max_bytes is None else None, max_bytes=max_bytes,
        batch_size=config.batch_size, init_scale=config.init_scale, seed=config.seed,
    )
    return result.to_dict()


def _text_ids(model, tokenizer, source: str) -> tuple[int, int]:
    """The (bos, pad) ids that text scoring frames and pads documents with; a ValueError naming `source`
    when its tokenizer is missing or has no bos token."""
    if tokenizer is None:
        raise ValueError(f"{source} has no tokenizer.json: text measurements need the model's tokenizer")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else model.config.bos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if bos is None:  # a retrofitted Qwen's: the document token training framed its text with (<|endoftext|>)
        from recurrent_depth.data.tokenizer import document_token_ids

        try:
            bos = document_token_ids(tokenizer)["begin_text"]
        except ValueError:
            bos = None
    if bos is None:
        raise ValueError(f"the tokenizer of {source} has no bos token (<|begin_text|>); text scores need one")
    return bos, pad


def _check_reasoning_model(model) -> None:
    if model.config.vocab_size < 288:
        raise ValueError("reasoning tasks need a model trained on them (byte tokenizer, vocabulary >= 288)")


def _reasoning(model, config: EvalConfig, task_name: str, depths: list[int]) -> dict[str, Any]:
    from recurrent_depth.evaluation.reasoning.data import ProblemEncoder
    from recurrent_depth.evaluation.reasoning.evaluate import accuracy_grid
    from recurrent_depth.evaluation.reasoning.tasks import get_task

    task = get_task(task_name)
    difficulties = config.difficulties or list(range(task.min_difficulty, task.min_difficulty + 9))
    grid = accuracy_grid(model, task, difficulties, depths, count=config.count, seed=config.seed + 1,
                         batch_size=config.batch_size, encoder=ProblemEncoder(), init_scale=config.init_scale)
    return grid.to_dict() | {"table": grid.table()}


def _task_manager(config: EvalConfig) -> Any:
    """lm-eval's task index (the shipped rd_* tasks and the user's include path included), the task names checked
    before any model loads."""
    from lm_eval.tasks import TaskManager

    from recurrent_depth.evaluation.lm_eval_env import check_task_names, quiet_git_probe
    from recurrent_depth.evaluation.tasks import TASKS_DIR

    # the user's folders, then ours: the order `rdepth lm-eval --include_path` gives (a later path's task of the
    # same name replaces an earlier one's, so rd_* names mean the shipped tasks in both commands)
    manager = TaskManager(include_path=[*config.lm_eval_include_path, str(TASKS_DIR)])
    check_task_names(manager, list(config.lm_eval_tasks))
    quiet_git_probe()
    return manager


def _lm_eval(
    path: str, config: EvalConfig, depths: list[int], fewshot: int, manager: Any, baseline: bool = False
) -> dict[int, dict[str, float]]:
    """task/metric -> {depth: value} for one few-shot count, one backend instance reused across depths. `baseline`:
    `path` is the baseline's (no --lora, no --tokenizer: the model's alone, even where both name one directory)."""
    import lm_eval

    from recurrent_depth.evaluation.lm_eval_backend import RecurrentDepthEvalLM

    extra = {"tokenizer": config.tokenizer} if config.tokenizer is not None and not baseline else {}
    lm = RecurrentDepthEvalLM(pretrained=path, device=config.device, batch_size=config.batch_size,
                              init_scale=config.init_scale, seed=config.seed,
                              dtype=config.dtype or "auto", **extra)
    quantize_weights(lm.model.core, config.weights)  # the wrapper shares the core's modules: both quantized
    if not baseline:  # the adapter onto the core in place: the wrapper shares its modules, so scores use it
        _with_adapter(lm.model.core, config)
    curves: dict[str, dict[int, float]] = {}
    for depth in depths:
        lm.depth = depth
        # generate_until draws each request's s_0 seed from the backend's stream: restart it, so that a depth's
        # generations get the seeds a fresh backend gives them, whatever depths ran before (a score at depth d
        # depended on the --depths list)
        lm._generator.manual_seed(config.seed)
        out = lm_eval.simple_evaluate(model=lm, tasks=list(config.lm_eval_tasks), num_fewshot=fewshot,
                                      limit=config.limit, task_manager=manager, random_seed=config.seed,
                                      numpy_random_seed=config.seed, torch_random_seed=config.seed,
                                      fewshot_random_seed=config.seed)
        for task, metrics in out["results"].items():
            for key, value in metrics.items():
                if isinstance(value, int | float) and "stderr" not in key and not key.startswith("sample_len"):
                    curves.setdefault(f"{task}/{key.split(',')[0]}", {})[depth] = float(value)
    return curves


def evaluate_depths(config: EvalConfig, log: Any = print) -> dict[str, Any]:
    """Run every measurement of `config`, write results.json and the figures, return the results."""
    from recurrent_depth.evaluation import plots

    config.validate()
    out = Path(config.out)
    check_out_dir(out)
    started = time.time()
    manager = _task_manager(config) if config.lm_eval_tasks else None
    model, tokenizer = _load(config.model, config.device, config.dtype, config.tokenizer, config.weights)
    model.max_depth = MAX_NUM_STEPS if config.max_depth is None else config.max_depth  # (the depths it scores)
    model = _with_adapter(model, config)  # a bad adapter: named now, before any scoring
    depths = config.depths
    if config.data is not None:  # a tokenizer text scoring cannot use: named now, not after the "text:" line
        _text_ids(model, tokenizer, config.model)
    if config.reasoning_tasks:  # a model that cannot take them: named now, not after the text scoring
        _check_reasoning_model(model)
    results: dict[str, Any] = {"config": asdict(config), "model_mean_recurrence": model.config.mean_recurrence}
    baseline = None
    if config.baseline is not None:
        baseline, baseline_tok = _load(config.baseline, config.device, config.dtype, weights=config.weights)
        baseline.max_depth = model.max_depth
        base_depth = config.baseline_depth if config.baseline_depth is not None else baseline.config.mean_recurrence
        ceiling = MAX_NUM_STEPS if config.max_depth is None else config.max_depth
        if config.baseline_depth is None and base_depth > ceiling:  # before any scoring
            raise ValueError(f"--baseline {config.baseline} has mean_recurrence={base_depth} (the default "
                             f"--baseline-depth), above the depth ceiling {ceiling}: give --baseline-depth <= "
                             f"{ceiling}, or raise --max-depth")
        if config.data is not None and baseline_tok is None:  # before the model's text is scored, not after
            raise ValueError(f"--baseline {config.baseline} has no tokenizer.json: text measurements need the "
                             "baseline's tokenizer")
        if config.data is not None:
            _text_ids(baseline, baseline_tok, f"--baseline {config.baseline}")
        results["baseline"] = {"model": config.baseline, "depth": base_depth}
    if config.data is not None:
        from recurrent_depth.data.corpus import load_corpus

        load_corpus(config.data, config.text_field)  # a bad --data: named now, not after "text:" (nor after mkdir)
    out.mkdir(parents=True, exist_ok=True)  # (after every check: a refused run leaves no empty --out behind)

    if config.data is not None:
        log(f"text: scoring {config.data} held-out documents at depths {depths}")
        text = _text_quality(model, tokenizer, config, depths)
        results["text"] = text
        curves = {"recurrent model": {int(d): v["bits_per_byte"] for d, v in text["by_depth"].items()}}
        lines = {}
        if baseline is not None:
            base = _text_quality(baseline, baseline_tok, config, [results["baseline"]["depth"]],
                                 max_bytes=text["bytes"], source=f"--baseline {config.baseline}")
            results["baseline"]["text"] = base
            lines[f"baseline (r={results['baseline']['depth']})"] = next(iter(base["by_depth"].values()))[
                "bits_per_byte"]
        plots.plot_metric_vs_depth(curves, out / "bits_per_byte_vs_depth.png", "bits per byte",
                                   "held-out text vs test-time depth", higher_is_better=False, baselines=lines)
        for d in depths:
            row = text["by_depth"][str(d)]
            log(f"  r={d:<4} loss {row['loss']:.4f}  ppl {row['perplexity']:.2f}  bpb {row['bits_per_byte']:.4f}")
        if baseline is not None:
            base = results["baseline"]["text"]
            row = next(iter(base["by_depth"].values()))
            log(f"  baseline {config.baseline} (r={results['baseline']['depth']}): loss {row['loss']:.4f}  "
                f"ppl {row['perplexity']:.2f}  bpb {row['bits_per_byte']:.4f}  (the same {base['bytes']:,} bytes; "
                f"model {text['bytes']:,})")

    for task_name in config.reasoning_tasks:
        log(f"reasoning: {task_name} at depths {depths}")
        grid = _reasoning(model, config, task_name, depths)
        results.setdefault("reasoning", {})[task_name] = grid
        from recurrent_depth.evaluation.reasoning.evaluate import AccuracyGrid

        restored = AccuracyGrid(grid["task"], grid["difficulty_name"], grid["difficulties"], grid["depths"],
                                grid["count"], {int(k): {int(r): a for r, a in v.items()}
                                                for k, v in grid["accuracy"].items()}, grid["chance"])
        plots.plot_reasoning_grid(restored, out / f"{task_name}_accuracy_vs_depth.png")
        log(grid["table"])

    if config.lm_eval_tasks:
        by_fewshot = {}
        for k in config.fewshot:
            log(f"lm-eval: {config.lm_eval_tasks} ({k}-shot) at depths {depths}")
            by_fewshot[k] = _lm_eval(config.model, config, depths, k, manager)
        results["lm_eval"] = {str(k): {name: {str(d): v for d, v in curve.items()} for name, curve in c.items()}
                              for k, c in by_fewshot.items()}
        first = by_fewshot[config.fewshot[0]]
        lines = {}
        if config.baseline is not None:
            base = _lm_eval(config.baseline, config, [results["baseline"]["depth"]], config.fewshot[0], manager,
                            baseline=True)
            results["baseline"]["lm_eval"] = {name: next(iter(c.values())) for name, c in base.items()}
            lines = {f"baseline {name}": v for name, v in results["baseline"]["lm_eval"].items()}
        plots.plot_metric_vs_depth(first, out / "accuracy_vs_depth.png", "score",
                                   f"lm-eval tasks ({config.fewshot[0]}-shot) vs test-time depth", baselines=lines)
        if len(config.fewshot) > 1:
            for name in first:
                plots.plot_fewshot_vs_depth({k: c[name] for k, c in by_fewshot.items()},
                                            out / f"fewshot_vs_depth_{name.replace('/', '_')}.png", name)
        for k, curves in by_fewshot.items():  # (one line per task and shot count: only the first count's were said)
            for name, curve in curves.items():
                log(f"  {name} ({k}-shot): " + "  ".join(f"r={d}: {v:.3f}" for d, v in sorted(curve.items())))

    results["seconds"] = round(time.time() - started, 1)
    results["torch_threads"] = torch.get_num_threads()
    # a diverging model's NaN losses are written as null: strict JSON readers refuse NaN
    atomic_write_text(out / "results.json",
                      json.dumps(finite_or_null(results), indent=2, default=str, allow_nan=False) + "\n")
    log(f"wrote {out / 'results.json'}")
    return results
