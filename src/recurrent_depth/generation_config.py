"""The generation defaults a model directory's generation_config.json sets (what transformers'
`model.generation_config` saves), read as our transformers classes read them, for `rdepth generate`,
`rdepth serve` and `serving.build_app`: one reader, so the same directory generates alike everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recurrent_depth.files import CONFIG_MAX_BYTES, read_json

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_MODES = ("auto", "none")
# the file's settings a server takes as its own --num-steps / --kv-quant (its KV pool, lm-eval's depth)
SERVER_SETTINGS = ("num_steps", "kv_quant")
# generation_config.json entries that set nothing a generate call reads (transformers' bookkeeping, the model
# config's own special ids): read without a word
_GENERATION_BOOKKEEPING = frozenset({"transformers_version", "_from_model_config", "bos_token_id", "pad_token_id"})
# entries transformers 5 writes into every generation_config.json it derives from a model config, at values that ask
# for what every decode here does anyway: read without a word too (a retrofit copies the file; a warning on each
# generate and serve for a file no one wrote by hand would be noise)
_GENERATION_NEUTRAL = {"output_attentions": False, "output_hidden_states": False, "use_cache": True}
# settings that shape sampling only: without do_sample they change nothing (transformers' rule)
_SAMPLING_SETTINGS = ("temperature", "top_k", "top_p", "min_p")
# options that run core steps: held to the depth ceiling (--max-depth) as the flags are
_DEPTH_OPTIONS = ("num_steps", "max_steps", "draft_steps", "inner_steps", "gradmem_depth", "ttt_depth", "ttt_backprop")


def generation_defaults(model_dir: str, mode: str, command: str, max_depth: int | None = None) -> dict[str, Any]:
    """The generation options a model directory's generation_config.json sets, by our option names ({} with mode
    "none" or without the file): our options and their official aliases, transformers' sampling fields,
    max_new_tokens, eos_token_id (`[]`, no eos, where the file has none, as in transformers) and stop_strings (as
    `stop`), as our transformers classes read them. A value of the wrong type, or a depth past the ceiling `max_depth`
    (--max-depth), is a one-line error naming the file; entries nothing here runs (num_beams, max_length, ...) are
    named in one warning on stderr."""
    import sys

    from recurrent_depth.config import check_depth
    from recurrent_depth.inference.options import OptionError
    from recurrent_depth.inference.schema import canonical, check_type, names_for

    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if mode == "none" or not path.is_file():
        return {}
    off = "(--generation-config none ignores the file)"
    values = read_json(path, CONFIG_MAX_BYTES, "generation config")
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(values).__name__} {off}")
    readable = (set(names_for("hf")) & set(names_for("cli"))) - {"defaults"}
    picked: dict[str, Any] = {}
    ignored = []
    for name, value in values.items():
        if name in readable:
            try:
                check_type(name, value)
            except OptionError as exc:
                raise ValueError(f"{path}: {exc} {off}") from None
            picked[name] = value
        elif name == "eos_token_id":
            if value is not None and not _token_ids(value):
                raise ValueError(f"{path}: eos_token_id={value!r} is invalid: expected a token id or a list of them "
                                 f"{off}")
            picked[name] = value
        elif name == "stop_strings":
            strings = [value] if isinstance(value, str) else value
            if value is not None and not (isinstance(strings, list) and all(isinstance(t, str) for t in strings)):
                raise ValueError(f"{path}: stop_strings={value!r} is invalid: expected a string or a list of them "
                                 f"{off}")
            if strings:
                picked["stop_strings"] = list(strings)
        elif name not in _GENERATION_BOOKKEEPING and not (name in _GENERATION_NEUTRAL
                                                          and value is _GENERATION_NEUTRAL[name]):
            ignored.append(name)
    if ignored:
        print(f"{command}: {path} sets {sorted(ignored)}, which {command} does not run; they are ignored "
              f"(--generation-config none ignores the whole file)", file=sys.stderr)
    strings = picked.pop("stop_strings", [])
    try:
        options, _ = canonical(picked)
    except OptionError as exc:
        raise ValueError(f"{path}: {exc} {off}") from None
    options = {k: v for k, v in options.items() if v is not None}
    # transformers' generate takes the eos ids of the file, none where it has none (absent or null): config.json's are
    # read only without the file, so a retrofitted Llama whose file lacks them stopped here but not there
    options.setdefault("eos_token_id", [])
    for name in _DEPTH_OPTIONS:  # as check_depth_flags checks the flags
        check_depth(options.get(name), f"{path}: {name}", max_depth)
    if strings:  # transformers' stop_strings beside our stop option: both stop a row
        stop = options.get("stop")
        options["stop"] = ([stop] if isinstance(stop, str | int) else list(stop or [])) + strings
    return options


def server_generation_defaults(model_dir: str, mode: str, command: str,
                               max_depth: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """`generation_defaults` for a server (`rdepth serve`, `build_app`): (the file's num_steps and kv_quant, which
    set the server's own --num-steps / --kv-quant where those are not given: its KV pool, lm-eval's depth; the
    rest, the defaults of the fields a request leaves out)."""
    defaults = generation_defaults(model_dir, mode, command, max_depth)
    return {name: defaults.pop(name, None) for name in SERVER_SETTINGS}, defaults


def _token_ids(value: Any) -> bool:
    ids = value if isinstance(value, list) else [value]
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)


def with_generation_defaults(given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The options given (flags, a request) over a directory's `generation_defaults`; the file's temperature, top_k,
    top_p and min_p only where the call samples (do_sample decides, as in transformers)."""
    merged = {**defaults, **given}
    if not merged.get("do_sample"):
        for name in _SAMPLING_SETTINGS:
            if name not in given:
                merged.pop(name, None)
    return merged


def with_turn_end(eos: Any, turn_end: list[int]) -> Any:
    """`eos` (an eos_token_id: an id, a list of them or None) with the chat template's end-of-turn ids `turn_end`
    joined after its own, as chat models on the Hub list them (Llama-3-Instruct's [128001, 128009]): transformers'
    `generate` then stops at the end of the assistant's turn, not at eos only (it ran on into a made-up next turn).
    `eos` itself where it holds them all already."""
    own = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    missing = [i for i in turn_end if i not in own]
    return own + missing if missing else eos


def check_generation_defaults(src: Path, remote_code: bool = True, before: str = "exporting") -> None:
    """Refuse (one line, before anything is written) a generation_config.json that no export can carry: one that is
    not a regular file (a FIFO, a link to /dev/zero: the copy left it out without a word) or not a JSON object
    (copied as it was, the copy's every from_pretrained was a TypeError); with `remote_code`, also one that sets
    options only the library runs (an exit criterion, a KV policy, ...): the exported file would refuse every plain
    `generate` call. `before`: what the refusal comes before ("exporting", "training", "averaging")."""
    path = src / GENERATION_CONFIG_FILE
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_file():  # (also a dangling link)
        raise ValueError(f"{path} is not a regular file: replace or remove it before {before}")
    values = read_json(path, CONFIG_MAX_BYTES, "generation config")
    if not isinstance(values, dict):
        raise ValueError(f"{path} is not a JSON object: fix or remove it before {before}")
    if not remote_code:
        return
    from recurrent_depth.integrations.remote.modeling_recurrent_depth import LIBRARY_ONLY_OPTIONS

    asked = sorted(k for k in LIBRARY_ONLY_OPTIONS if values.get(k) is not None)
    if asked:
        raise ValueError(f"{src / GENERATION_CONFIG_FILE} sets {asked}, which only the recurrent_depth library runs: "
                         f"the --remote-code copy would refuse every generate call that does not unset them; remove "
                         f"them there (or load the model with the library)")
