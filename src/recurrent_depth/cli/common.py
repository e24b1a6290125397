"""Flags shared by several subcommands, defined once so they read the same everywhere."""

from __future__ import annotations

import argparse

from recurrent_depth.generation_config import GENERATION_CONFIG_MODES


def add_model_arg(parser: argparse.ArgumentParser, required: bool = True, help: str | None = None) -> None:
    parser.add_argument(
        "--model", required=required, metavar="DIR", type=model_dir,
        help=help or "a saved model directory (ours, an official Huginn-0125 one or an Ouro one; tokenizer inside), "
                     "or a run directory of `rdepth train` / `quickstart`, whose model/ is used",
    )


def model_dir(text: str) -> str:
    """argparse type of --model: a run directory (no config.json, but model/config.json) means its model/."""
    return run_model_dir(text, "--model")


def baseline_dir(text: str) -> str:
    """argparse type of eval's --baseline: a run directory means its model/, as for --model."""
    return run_model_dir(text, "--baseline")


def run_model_dir(text: str, flag: str) -> str:
    """`text`, or its model/ when it is a run directory (no config.json, but model/config.json), said on stderr."""
    import sys
    from pathlib import Path

    path = Path(text)
    try:
        run_dir = not (path / "config.json").exists() and (path / "model" / "config.json").is_file()
    except OSError:  # (a name too long for the file system: argparse printed its traceback; check_model_path says it)
        return text
    if run_dir:
        print(f"rdepth: {flag} {text} is a run directory; using its model {path / 'model'}", file=sys.stderr)
        return str(path / "model")
    return text


def check_model_path(path: str, flag: str = "--model") -> None:
    """A model flag's path checked before anything loads, with the same one-line errors in every command:
    no such path, a file (a model's own config.json or weights, say), a directory without config.json."""
    from pathlib import Path

    p = Path(path)
    if p.is_file():
        # `--model run/model/config.json` (or its model.safetensors): the directory holding it was meant
        parent = f": pass the directory holding it, {flag} {p.parent}" if p.name in MODEL_FILES or \
            p.suffix == ".safetensors" else " (expected a saved model directory)"
        raise NotADirectoryError(f"{flag} {path} is not a directory but a file{parent}")
    if not p.is_dir():
        raise FileNotFoundError(f"{flag} {path}: no such directory (expected a saved model directory)")
    if not (p / "config.json").exists():
        raise FileNotFoundError(no_model_message(path, flag))


# files of a saved model directory: a path to one of them means the directory
MODEL_FILES = frozenset({"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                         "model.safetensors.index.json"})


def no_model_message(path: str, flag: str = "--model") -> str:
    """What to pass when a model flag names a directory without config.json."""
    from recurrent_depth.checkpoint import lora_adapter_hint

    return (f"{flag} {path} has no config.json: expected a saved model directory (config.json, "
            f"model.safetensors, tokenizer.json) or a run directory holding one in model/"
            + (lora_adapter_hint(path) + _adapter_location(path) or _checkpoint_hint(path, flag)))


def _adapter_location(path: str) -> str:
    """Where a LoRA run directory's adapter is and the base it was trained on (its adapter_config.json), so the
    hint's --lora can be typed: given the run, not its model/, the adapter's path was nowhere in the message; given
    the adapter itself (`rdepth info --model run/model`), its base was not."""
    from pathlib import Path

    from recurrent_depth.files import read_json

    adapter = Path(path) / "model"
    if (Path(path) / "adapter_config.json").is_file():
        adapter = Path(path)
    elif not (adapter / "adapter_config.json").is_file():
        return ""
    try:
        base = read_json(adapter / "adapter_config.json", what="LoRA adapter config").get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):  # (an unreadable config: the adapter's path alone still helps)
        base = None
    return f" (the adapter: {adapter}" + (f"; its base: {base})" if isinstance(base, str) and base else ")")


def _checkpoint_hint(path: str, flag: str) -> str:
    """'' or, for a run's checkpoints/ directory or a run stopped before it saved model/, its newest checkpoint
    (step-NNNNNNNN directories, which are model directories) to pass instead."""
    from pathlib import Path

    p = Path(path)
    steps = sorted(d for base in (p, p / "checkpoints") if base.is_dir() for d in base.glob("step-*")
                   if (d / "config.json").is_file())
    return f"; it holds training checkpoints: pass one, e.g. the newest, {flag} {steps[-1]}" if steps else ""


def add_lora_adapter_arg(parser: argparse.ArgumentParser) -> None:
    """`--lora ADAPTER_DIR` for commands that run a model (the adapter applied by `train.lora.attach_adapter`)."""
    parser.add_argument("--lora", default=None, metavar="ADAPTER_DIR",
                        help="a peft LoRA adapter directory to apply to --model, unmerged (e.g. the model/ of an "
                             "`rdepth train --lora` run; on --weights int8/int4 layers too, QLoRA-style, but for "
                             "DoRA; needs recurrent-depth[lora]; default: none)")
    add_strict_lora_base_arg(parser, "--lora")


def add_strict_lora_base_arg(parser: argparse.ArgumentParser, adapter_flag: str) -> None:
    """`--strict-lora-base`: refuse an adapter whose recorded base fingerprint is not --model's (default: warn)."""
    parser.add_argument("--strict-lora-base", action="store_true",
                        help=f"refuse the {adapter_flag} adapter when --model's weights are not the ones it was "
                             f"trained on (the base fingerprint it records); default: a warning, since an adapter "
                             f"may be meant for a sibling fine-tune of its base")


def check_strict_lora_base(args: argparse.Namespace, adapter_flag: str) -> None:
    """--strict-lora-base without an adapter to check does nothing: say so instead."""
    if args.strict_lora_base and getattr(args, adapter_flag.removeprefix("--").replace("-", "_")) is None:
        raise ValueError(f"--strict-lora-base checks the base of a {adapter_flag} adapter: add {adapter_flag} "
                         f"(or leave it out)")


def check_lora_with_weights(args: argparse.Namespace, adapter_dirs: list[str] | None = None) -> None:
    """--lora with --weights: the adapter goes onto the int8 / int4 layers unmerged (QLoRA-style,
    `train.lora.on_quantized_layers`); a DoRA adapter, which cannot (it reads the float base weight's norm), is
    refused before the model loads. adapter_dirs: the adapters to check (default: --lora's; `rdepth serve`'s
    --lora-modules). (Imports torch when there is one to check: called at run time, not at import.)"""
    weights = getattr(args, "weights", None)
    lora = getattr(args, "lora", None)
    adapter_dirs = adapter_dirs if adapter_dirs is not None else [] if lora is None else [lora]
    if weights is not None and adapter_dirs:
        from recurrent_depth.train.lora import check_adapter_dir, refuse_dora_on_quantized

        for adapter_dir in adapter_dirs:
            refuse_dora_on_quantized(check_adapter_dir(adapter_dir), weights)


def add_out_arg(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--out", default=default, metavar="DIR", help="output directory (default: %(default)s)")


def add_seed_arg(parser: argparse.ArgumentParser, default: int = 0) -> None:
    parser.add_argument("--seed", type=int, default=default, help="random seed (default: %(default)s)")


def add_threads_arg(parser: argparse.ArgumentParser, measured: bool = True) -> None:
    default = ("measured at start from the cores other processes leave free; 1 when the machine is busy"
               if measured else "torch's")
    parser.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                        help=f"torch CPU threads, at most {THREADS_PER_CORE} per CPU core (default: {default})")


# --threads' ceiling per core: a few times the cores can help on a busy machine; 100000 threads made OpenMP's thread
# creation fail (a segfault at the first matmul), and above 2**31 torch raised "Overflow when unpacking long"
THREADS_PER_CORE = 8


def _positive_int(text: str) -> int:
    import os

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    limit = THREADS_PER_CORE * (os.cpu_count() or 1)
    if value > limit:
        raise argparse.ArgumentTypeError(f"expected an integer <= {limit} ({THREADS_PER_CORE} per CPU core of this "
                                         f"machine), got {text}")
    return value


def add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", type=_run_device, help="torch device (default: %(default)s)")
    add_dtype_arg(parser, "load weights in this dtype")


def _run_device(text: str) -> str:
    """argparse type of --device: 'meta' loads (tensors without data) and then failed at the first .item(), a
    traceback from torch; a usage error here instead."""
    if text.split(":", 1)[0] == "meta":
        raise argparse.ArgumentTypeError(f"{text!r} holds no data, nothing can run on it: expected e.g. cpu or cuda")
    return text


# --dtype's values, and the short names `rdepth train --dtype` takes too (bf16 there and here alike)
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def add_dtype_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """`--dtype {float32,bfloat16,float16}` (or fp32 / bf16 / fp16), default None: as stored."""
    parser.add_argument("--dtype", default=None, choices=DTYPE_CHOICES, type=_dtype_name,
                        help=f"{what} (or fp32 / bf16 / fp16; default: as stored)")


def _dtype_name(text: str) -> str:
    name = text.lower()
    return DTYPE_ALIASES.get(name, name)


def add_weights_arg(parser: argparse.ArgumentParser) -> None:
    """--weights at load (the formats of `weight_quant.parse_weights`; training runs' QLoRA flag: train.lora)."""
    parser.add_argument(
        "--weights", default=None, metavar="FORMAT",
        help="weight-only quantization at load of the transformer's linear layers (not the embedding or the "
             "head): 'int8' (per output channel; about 2x faster bf16 decode of large models on CPU), 'int4' "
             "(group-wise, 32 input columns a group; 'int4:g64', 'int4:g128', 'int4:g256' for other groups), "
             "'nf4' (QLoRA's NormalFloat, blocks of 64; 'nf4:g32' ... 'nf4:g256'; 'nf4:dq' / 'nf4:dq:g128' "
             "double-quantize its absmax to 8 bits; a C++ decode kernel near int4's speed a row); "
             "LoRA adapters go on the quantized layers unmerged (QLoRA-style; not DoRA). docs/inference.md. "
             "Default: the weights as loaded",
    )


def add_max_depth_arg(parser: argparse.ArgumentParser) -> None:
    from recurrent_depth.config import MAX_NUM_STEPS

    parser.add_argument(
        "--max-depth", type=int, default=None, metavar="N",
        help=f"depth ceiling: no recurrence runs deeper than N core steps (default: {MAX_NUM_STEPS}, "
             f"MAX_NUM_STEPS; raise it for deliberately deep runs)",
    )


def check_depth_flags(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """Each depth flag within the depth ceiling (--max-depth, default MAX_NUM_STEPS), before any work; a
    flag holding a list (eval's --depths) has each entry checked."""
    from recurrent_depth.config import check_depth

    if args.max_depth is not None and args.max_depth < 1:
        raise ValueError(f"--max-depth={args.max_depth} is invalid: expected an integer >= 1")
    for flag in flags:
        value = getattr(args, flag)
        for depth in value if isinstance(value, list) else [value]:
            check_depth(depth, "--" + flag.replace("_", "-"), args.max_depth)


def add_tokenizer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer", default=None, metavar="DIR",
        help="tokenizer directory (or tokenizer.json) to use (default: the one inside --model)",
    )


def add_load_args(parser: argparse.ArgumentParser) -> None:
    """What a command that runs a trained model loads, and how: --model, --lora, --tokenizer, --device,
    --dtype and --weights."""
    add_model_arg(parser)
    add_lora_adapter_arg(parser)
    add_tokenizer_arg(parser)
    add_device_args(parser)
    add_weights_arg(parser)


def tokenizer_source(args: argparse.Namespace) -> str:
    """Where the command's tokenizer lives: --tokenizer, else the --model directory (which must hold one)."""
    from pathlib import Path

    if args.tokenizer is not None:
        return args.tokenizer
    model = Path(args.model)
    check_model_path(args.model)
    if not (model / "tokenizer.json").exists() and (model / "tokenizer.model").exists():
        raise FileNotFoundError(
            f"{args.model} has only a sentencepiece tokenizer.model, and rdepth reads tokenizer.json: convert it "
            f"(transformers with sentencepiece installed: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)) "
            f"or pass --tokenizer DIR"
        )
    if not (model / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"{args.model} has no tokenizer.json; pass --tokenizer DIR, or save the model with its tokenizer "
            f"(model.save_pretrained(dir, tokenizer=...))"
        )
    return args.model


def load_cli_tokenizer(args: argparse.Namespace):
    """The `tokenizers.Tokenizer` of --tokenizer / --model, read as untrusted input (one-line errors)."""
    from recurrent_depth.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_source(args))


def human_bytes(count: int) -> str:
    """1536 -> '1.5 KiB' (binary units, as memory is sized)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_count(count: int) -> str:
    """3564976800 -> '3.56 B' (parameter counts, as papers write them)."""
    for size, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(count) >= size:
            return f"{count / size:.3g} {unit}"
    return str(count)


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers, at least one."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


# ------------------------------------------------------------------------------------- generation defaults
# what `generation_defaults` reads, for --help
GENERATION_CONFIG_KEYS = ("num_steps and our other generation options, do_sample, temperature, top_k, top_p, min_p, "
                          "repetition_penalty, max_new_tokens, seed, eos_token_id, stop_strings")


def add_generation_config_arg(parser: argparse.ArgumentParser, sets: str) -> None:
    """`--generation-config {auto,none}`: whether the model directory's generation_config.json sets defaults
    (`sets`: what it sets for this command)."""
    parser.add_argument(
        "--generation-config", choices=GENERATION_CONFIG_MODES, default="auto",
        help=f"'auto': the model directory's generation_config.json (what transformers' model.generation_config "
             f"saves) {sets}; 'none': ignore the file (default: %(default)s)")
