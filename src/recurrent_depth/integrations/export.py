"""Export a model directory that a plain transformers environment loads with `trust_remote_code=True`.

The exported directory holds our usual files (config.json, safetensors weights, tokenizer files, the
model card README.md where the source has one) plus `modeling_recurrent_depth.py` (one self-contained
file: torch + transformers) and an `auto_map` in config.json that points the Auto classes at it, the
way Huginn-0125 itself ships.
In a process that imported `recurrent_depth`, the library's own classes take precedence.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from recurrent_depth.checkpoint import TOKENIZER_FILES, copy_tokenizer, save_pretrained
from recurrent_depth.config import HUGINN_ARCHITECTURE, HUGINN_MODEL_TYPE, MODEL_TYPE, ModelConfig
from recurrent_depth.families.retrofit import PROVENANCE_FILE
from recurrent_depth.files import (
    CONFIG_MAX_BYTES,
    atomic_write_bytes,
    atomic_write_text,
    inside,
    link_note,
    read_bytes,
    read_json,
)
from recurrent_depth.generation_config import GENERATION_CONFIG_FILE, check_generation_defaults, with_turn_end
from recurrent_depth.model.recurrent import RecurrentDepthLM

REMOTE_CODE_FILE = "modeling_recurrent_depth.py"
AUTO_MAP = {
    "AutoConfig": "modeling_recurrent_depth.RecurrentDepthConfig",
    "AutoModelForCausalLM": "modeling_recurrent_depth.RecurrentDepthForCausalLM",
    "AutoModelForSequenceClassification": "modeling_recurrent_depth.RecurrentDepthForSequenceClassification",
}
SUPPORTED_MIXER_OPTIONS = frozenset({"window"})
# What a model directory carries beside its config, weights and tokenizer (`read_companions`).
COMPANION_FILES = (PROVENANCE_FILE, GENERATION_CONFIG_FILE)
# The Hugging Face model card. An export carries it (the same model in another format); a run's checkpoints and
# averages do not (another model than the card describes).
MODEL_CARD = "README.md"


def remote_code_source() -> str:
    """The text of the self-contained modeling file."""
    return resources.files("recurrent_depth.integrations.remote").joinpath(REMOTE_CODE_FILE).read_text()


def check_exportable(config: ModelConfig) -> None:
    """The remote-code file implements softmax attention only; say so before writing anything."""
    mixers = set(config.mixer.values()) if isinstance(config.mixer, dict) else {config.mixer}
    if mixers != {"attention"}:
        raise ValueError(
            f"--remote-code supports the 'attention' mixer only; this model uses {sorted(mixers)}. "
            "Load it with the recurrent_depth library instead (AutoModelForCausalLM works after "
            "`import recurrent_depth`)"
        )
    unsupported = sorted(set(config.mixer_options) - SUPPORTED_MIXER_OPTIONS)
    if unsupported:
        raise ValueError(
            f"--remote-code supports mixer_options {sorted(SUPPORTED_MIXER_OPTIONS)} only; got {unsupported}"
        )
    if not config.uses_huginn_layout:
        changed = sorted(k for k, v in HUGINN_ARCHITECTURE.items() if getattr(config, k) != v)
        if config.attention_scale != config.head_dim**-0.5:
            changed.append(f"attn_scale={config.attention_scale_rule!r}")
        raise ValueError(
            f"--remote-code implements Huginn's architecture only; this model sets {changed} (an Ouro, Parcae "
            "or retrofitted model). Load it with the recurrent_depth library instead (AutoModelForCausalLM works "
            "after `import recurrent_depth`)"
        )


def read_companions(src: Path, before: str = "exporting") -> dict[str, bytes]:
    """{name: bytes} of what `src` carries beside its config, weights and tokenizer that its copies keep (an export,
    a run's checkpoints, an average): retrofit's record of the source (retrofit.json) and the generation defaults
    (generation_config.json). Read (bounded) before anything is written; a file no copy could carry (not a regular
    file, not a JSON object) is refused in one line: a retrofit.json that was a FIFO, a link to /dev/zero or a
    dangling link was left out without a word (the copies then lost the record of their source). `before`: what
    the refusal comes before ("exporting", "training", "averaging")."""
    check_generation_defaults(src, remote_code=False, before=before)
    files: dict[str, bytes] = {}
    for name, what in zip(COMPANION_FILES, ("retrofit record", "generation config"), strict=True):
        path = src / name
        if not path.exists() and not path.is_symlink():
            continue
        if not path.is_file():  # (also a dangling link: as check_generation_defaults refuses one)
            raise ValueError(f"{path} is not a regular file: replace or remove it before {before}")
        files[name] = read_bytes(path, CONFIG_MAX_BYTES, what)
    return files


def read_model_card(src: Path) -> bytes | None:
    """`src`'s model card (README.md), None without one: a bounded read of a regular file inside `src`. A link
    leading out of `src` is refused in one line (an export would publish whatever it names), except a Hugging Face
    hub snapshot's link into its repository's blob store, which is how a downloaded model holds each file."""
    path = src / MODEL_CARD
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() and not _hub_blob(path, src):
        inside(src, MODEL_CARD, "model card")
    if not path.exists():
        raise ValueError(f"model card {path}{link_note(path)} leads nowhere: replace or remove it before exporting")
    return read_bytes(path, CONFIG_MAX_BYTES, "model card")


def _hub_blob(path: Path, src: Path) -> bool:
    """Whether `path` leads into the blob store of the hub repository whose snapshot `src` is
    (`<repo>/snapshots/<revision>/README.md` -> `<repo>/blobs/<hash>`)."""
    snapshot = src.resolve()
    return snapshot.parent.name == "snapshots" and path.resolve().parent == snapshot.parent.parent / "blobs"


def copy_companions(src: Path, out: Path) -> None:
    """What a model directory carries beside its config and weights: the tokenizer files, retrofit's record of
    the source and the generation defaults that transformers' `generate` reads (generation_config.json: num_steps,
    eos_token_id, max_new_tokens, ...; without it the copy generated otherwise); each a bounded read (a
    tokenizer.json linked to /dev/zero filled the disk). Those of them `src` lacks are removed from `out` (another
    model's, where `out` held one). The model card (README.md, `read_model_card`) is carried too; without one in
    `src`, a README.md already in `out` is left (no loader reads it, and it may be the user's own)."""
    if src.resolve() == out.resolve():
        return
    companions = read_companions(src)  # before anything is written
    card = read_model_card(src)
    out.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(src, out)
    for name, data in companions.items():
        atomic_write_bytes(out / name, data)
    if card is not None:
        atomic_write_bytes(out / MODEL_CARD, card)
    remove_absent(out, src, (*TOKENIZER_FILES, *COMPANION_FILES))
    stop_at_turn_end(src, out)


def replace_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    """`out`'s tokenizer files become `tokenizer_dir`'s (`export --tokenizer`): copied, and those it lacks removed
    (a chat_template.jinja of --model's beside --tokenizer's files was the chat template transformers rendered)."""
    copy_tokenizer(tokenizer_dir, out)
    remove_absent(out, tokenizer_dir, TOKENIZER_FILES)


def remove_absent(out: Path, src: Path, names: tuple[str, ...]) -> None:
    """Remove each of `names` from `out` that `src` lacks: an export over a directory that held another model left
    that model's tokenizer.model, chat template, generation_config.json or retrofit.json beside the new weights,
    where transformers and our loaders read them as the exported model's."""
    if src.resolve() == out.resolve():
        return
    for name in names:
        stale = out / name
        if not (src / name).exists() and (stale.is_symlink() or stale.is_file()):
            stale.unlink()


def stop_at_turn_end(model_dir: Path, out: Path) -> None:
    """Make `out`'s generation_config.json stop transformers' `generate` at the end of a chat turn: the ids `rdepth
    serve` ends a chat at (`turn_end_ids` of `out`'s tokenizer and chat template: `<|end_turn|>`, ChatML's
    `<|im_end|>`) joined to its eos_token_id, after the file's own ids (a retrofitted Qwen's list), else the model's
    eos (`model_dir`'s config). Without them `tok.apply_chat_template(..., add_generation_prompt=True)` then
    `model.generate` stopped at eos only and ran on into a made-up next turn. Nothing is written without a chat
    template, or where the file lists them already; a new file holds the model config's special ids."""
    from recurrent_depth.serving.text import turn_end_ids

    config = ModelConfig.from_json(model_dir / "config.json")
    turn_end = turn_end_ids(out, config.vocab_size)
    if not turn_end:
        return
    path = out / GENERATION_CONFIG_FILE
    if path.is_file():  # (checked before anything was written: a regular file holding a JSON object)
        values = read_json(path, CONFIG_MAX_BYTES, "generation config")
    else:
        values = {"bos_token_id": config.bos_token_id, "pad_token_id": config.pad_token_id}
    own = values.get("eos_token_id")
    joined = with_turn_end(config.eos_token_id if own is None else own, turn_end)
    if joined == own:
        return
    values["eos_token_id"] = joined
    atomic_write_text(path, json.dumps(values, indent=2) + "\n")


def official_code_files(code_dir: Path) -> dict[str, Any]:
    """The `auto_map` of an official Huginn-0125 directory (`code_dir`, say the download a model was fine-tuned
    from), checked to name Python files beside it: what `export --official-layout --official-code` copies so that
    `trust_remote_code=True` runs the official modeling code. One line naming what is missing otherwise."""
    config = code_dir / "config.json"
    raw = read_json(config, CONFIG_MAX_BYTES, "config file") if config.is_file() else None
    auto_map = raw.get("auto_map") if isinstance(raw, dict) and raw.get("model_type") == HUGINN_MODEL_TYPE else None
    if not isinstance(auto_map, dict) or not auto_map:
        raise ValueError(f"--official-code {code_dir}: expected an official Huginn-0125 directory, whose config.json "
                         f"(model_type {HUGINN_MODEL_TYPE!r}) has an auto_map naming its modeling files")
    for target in auto_map.values():
        name = _module_file(target)
        if Path(name).name != name or not (code_dir / name).is_file():
            raise ValueError(f"--official-code {code_dir}: its auto_map names {target!r}, but {name} is not a file "
                             f"there")
    return auto_map


def _module_file(target: Any) -> str:
    """The file an auto_map entry ("module.Class") names: "module.py"."""
    return f"{str(target).rsplit('.', 1)[0]}.py"


def official_code_present(model_dir: Path) -> bool:
    """Whether `model_dir` is an official Huginn-0125 directory holding the modeling files its auto_map names."""
    try:
        official_code_files(model_dir)
    except ValueError:
        return False
    return True


def copy_official_code(code_dir: Path, out: Path) -> None:
    """Add the official modeling files `code_dir`'s auto_map names (`official_code_files`) to the official-layout
    directory `out`, with that auto_map in its config.json."""
    auto_map = official_code_files(code_dir)
    for target in auto_map.values():
        name = _module_file(target)
        atomic_write_bytes(out / name, read_bytes(code_dir / name, CONFIG_MAX_BYTES, "official modeling file"))
    values = read_json(out / "config.json", CONFIG_MAX_BYTES, "config file")
    values["auto_map"] = dict(auto_map)
    atomic_write_text(out / "config.json", json.dumps(values, indent=2) + "\n")


def export_remote_code(model_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write (or add, when `out_dir` is None or equals `model_dir`) the remote-code files.

    Official Huginn-0125 directories are converted to our config and weight layout on the way.
    Returns the output directory.
    """
    src = Path(model_dir)
    out = Path(out_dir) if out_dir is not None else src
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json; expected a saved model directory")
    config = ModelConfig.from_json(src / "config.json")
    check_exportable(config)
    check_generation_defaults(src)
    raw = read_json(src / "config.json", CONFIG_MAX_BYTES, "config file")
    if any(str(name).endswith("ForSequenceClassification") for name in raw.get("architectures") or []):
        raise ValueError(f"{src} holds a sequence classifier (architectures {raw['architectures']}): --remote-code "
                         "exports causal-LM directories (whose auto_map also names the exported file's sequence "
                         "classifier); load this one with AutoModelForSequenceClassification after "
                         "`import recurrent_depth`")
    # Loaded as the library loads it, also in place (where the weights stay as stored): transformers loads what the
    # library refuses (a missing tensor, initialised at random; a tied head that differs from the embedding, left
    # untied; NaN) with a warning, and the export then computed another model's logits.
    model = RecurrentDepthLM.from_pretrained(src)
    if raw.get("model_type") != MODEL_TYPE or out.resolve() != src.resolve():
        # Re-save through the library: our key names, tied head stored once, no RoPE buffer.
        copy_companions(src, out)  # first: a refused tokenizer file leaves no weights without a tokenizer
        save_pretrained(model, out)
    values: dict[str, Any] = config.to_dict()
    values["architectures"] = ["RecurrentDepthForCausalLM"]
    # The dtype the library computes in (the embedding's): without it transformers took the first stored tensor's,
    # and weights stored in mixed dtypes (in place) ran in bfloat16 where the library ran in float32.
    values["dtype"] = str(model.transformer.wte.weight.dtype).removeprefix("torch.")
    values["auto_map"] = dict(AUTO_MAP)
    # The file before the auto_map naming it: a failure between the two left a config.json that transformers
    # could not load (no module modeling_recurrent_depth), in place the source model's own.
    atomic_write_text(out / REMOTE_CODE_FILE, remote_code_source())
    atomic_write_text(out / "config.json", json.dumps(values, indent=2, sort_keys=True) + "\n")
    stop_at_turn_end(out, out)  # (also in place, where no companions were copied)
    return out
