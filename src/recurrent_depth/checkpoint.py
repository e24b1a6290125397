"""safetensors checkpoints: ours, the official Huginn-0125 layout, Ouro's and Parcae's, single file or sharded.

A model directory holds `config.json` and `model.safetensors` (or `model-0000i-of-0000n.safetensors`
shards plus `model.safetensors.index.json`), and usually the tokenizer files. Nothing is ever
unpickled. Tied weights are stored once (`transformer.wte.weight`) and re-tied on load; an official
file's extra `lm_head.weight` is accepted when it equals the embedding, its `freqs_cis` buffer is
ignored (we compute our own RoPE table). An Ouro directory (`model_type: "ouro"`) is read through
`families/ouro.py`: its tensors are checked under their own names, then renamed and fused into ours.
A Parcae directory (`_class_name: "ParcaeConfig"`) is read through `families/parcae.py`: its header
entries renamed before the checks, its tensors after the read. Saving writes our own format;
`save_official_layout` writes the official Huginn-0125 one (`rdepth export --official-layout`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from recurrent_depth.config import ModelConfig
from recurrent_depth.families import ouro, parcae
from recurrent_depth.files import (
    CONFIG_MAX_BYTES,
    TMP_SUFFIX,
    TOKENIZER_MAX_BYTES,
    atomic_write_text,
    clipped,
    clipped_names,
    file_sha256,
    fsync_dir,
    fsync_file,
    inside,
    open_regular,
    parse_json,
    parse_safetensors_header,
    read_bytes,
    read_json,
    read_safetensors_header,
    read_text,
    reopen_path,
)
from recurrent_depth.weight_quant import check_saveable, check_weights, quantize_weights

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
IGNORED_TENSORS = ("freqs_cis",)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "tokenizer_training.json",
    "tokenizer.model",  # a sentencepiece tokenizer (a retrofitted source's), for transformers' loaders
)
# The tokenizer files that decide what a run trains on, so a resume checks them (`trainer_checkpoints`): the
# vocabulary, merges and added tokens (tokenizer.json) and the chat template with the special tokens it renders
# (chat_template.jinja, tokenizer_config.json), through which `rdepth sft` and `rdepth rl` turn chats into ids.
# Not the rest: training never reads special_tokens_map.json (transformers' copy of what tokenizer_config.json
# names), tokenizer.model (we read tokenizer.json only), tokenizer_training.json (a record of how it was
# trained) or generation_config.json (RL's rollouts take their options from the command line).
TRAINING_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def dtype_from_name(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype={name!r} is invalid: expected one of {sorted(table)}")
    return table[name]


def save_pretrained(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str] | None = None,
    max_shard_bytes: int | None = None,
    metadata: dict[str, str] | None = None,
    tokenizer: Any = None,
) -> None:
    """Write config.json + safetensors weights atomically, and the tokenizer when given, so that the
    directory serves `from_pretrained`, transformers' Auto classes and every `--model` option.

    `tokenizer`: a `tokenizers.Tokenizer`, a transformers tokenizer, or a directory holding one
    (`tokenizer_dir` is the older name for the directory form). `max_shard_bytes` splits the weights
    into shards with an index file (as large checkpoints are). Files get the permissions the umask gives.
    Over an existing model directory the new weights and config are written beside the old ones and renamed into
    place at the end, so a process killed while saving leaves the old model or the new one, whole (shards that would
    replace the old model's shards of the same names are named `model-<i>-of-<n>-b.safetensors` instead).
    """
    check_saveable(model, path)  # before anything in `path` is touched
    for given in (tokenizer_dir, tokenizer):
        _check_tokenizer_fits(given, model.config.vocab_size)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)
        if ptr in seen and name == "lm_head.weight":
            continue  # tied to the embedding: stored once
        seen.add(ptr)
        state[name] = tensor.detach().contiguous().cpu()
    config = model.config
    if untied_head(model):  # (saved as the model computes: both tensors, and a config that does not tie them)
        config = dataclasses.replace(config, tie_embeddings=False)
    _write_weights(state, out, max_shard_bytes, metadata, config.to_json())
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    if tokenizer is not None:
        save_tokenizer_files(tokenizer, out, model_max_length=model.config.max_seq_len)


def _write_weights(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int | None,
                   metadata: dict[str, str] | None, config_text: str) -> None:
    """`state` as model.safetensors, or as shards of at most `max_shard_bytes` plus their index, and `config_text` as
    config.json, replacing the model `out` held so that a process killed at any point leaves one complete model:
    every file is written and fsynced under a temporary name first (the slow part; the old model is untouched), then
    renamed into place, the index last. The other layout's entry file goes with them: an old index after the new
    model.safetensors is in place, an old model.safetensors (which `weight_files` loads before an index) just before
    the new index arrives, once the new shards are in place. The old shards the new save does not use are removed
    only after that."""
    meta = {"format": "pt", **(metadata or {})}
    total = sum(t.nbytes for t in state.values())
    files: dict[str, dict[str, torch.Tensor]] = {}
    index_text = None
    if max_shard_bytes is None or total <= max_shard_bytes:
        files[WEIGHTS_NAME] = state
    else:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in state.items():
            if shards[-1] and size + tensor.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensor
            size += tensor.nbytes
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}" for i in range(len(shards))]
        # Renamed one by one over the old model's shards of the same names, a kill midway would mix the two models:
        # then this save's shards take other names (the index names them for every reader).
        mark = "-b" if _loads_any(out, [f"{name}.safetensors" for name in names]) else ""
        files = {f"{name}{mark}.safetensors": shard for name, shard in zip(names, shards, strict=True)}
        weight_map = {name: filename for filename, shard in files.items() for name in shard}
        index_text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    texts = {"config.json": config_text, **({INDEX_NAME: index_text} if index_text is not None else {})}
    staged: list[tuple[Path, Path]] = []  # (temporary, final): weights, config.json, then the index
    try:
        for filename, tensors in files.items():
            staged.append((out / (filename + TMP_SUFFIX), out / filename))
            save_file(tensors, str(staged[-1][0]), metadata=meta)
            os.chmod(staged[-1][0], 0o666 & ~current_umask())  # safetensors creates 0600 files; others follow umask
            fsync_file(staged[-1][0])
        for filename, text in texts.items():
            staged.append((out / (filename + TMP_SUFFIX), out / filename))
            with open(staged[-1][0], "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    stale = [path for path in out.glob("model*.safetensors") if path.name not in files]
    with _signals_deferred():  # Ctrl-C or SIGTERM between two renames would leave old and new mixed
        for tmp, final in staged:
            if final.name == INDEX_NAME:  # an old single-file save's model.safetensors is loaded before an index
                # (`weight_files`): gone first, so a kill between the two leaves the new shards, not the old weights
                (out / WEIGHTS_NAME).unlink(missing_ok=True)
            os.replace(tmp, final)
        if index_text is None:  # (an old sharded save's index, no longer describing this model)
            (out / INDEX_NAME).unlink(missing_ok=True)
        fsync_dir(out)
    for path in [*stale, *out.glob(f"model*.safetensors{TMP_SUFFIX}")]:  # (and what a killed save left)
        path.unlink(missing_ok=True)


def _loads_any(out: Path, names: list[str]) -> bool:
    """Whether the model in `out` loads from a file of one of these `names` (`weight_files`; False: no model)."""
    try:
        loaded = set(weight_files(out))
    except (OSError, ValueError):
        return False
    return any(out / name in loaded for name in names)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM (delivered when the block ends) where this thread can block signals (Unix)."""
    held = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def save_official_layout(model: torch.nn.Module, path: str | os.PathLike[str],
                         max_shard_bytes: int | None = None) -> None:
    """Write `model` as the official Huginn-0125 files are (huginn-0125.md §2), for the official modeling code
    (`trust_remote_code=True`) and this library alike: `RavenConfig` keys (`ModelConfig.to_huginn_dict`, which
    refuses a model the official code cannot run) with `torch_dtype`, the same tensor names, the tied
    `lm_head.weight` stored beside the embedding and the persistent `freqs_cis` RoPE buffer ([1, T, 1, hd/2, 2]
    (cos, sin), float32), which the official code reads from the file. No tokenizer: the caller copies it."""
    from recurrent_depth.model.layers import rope_table

    config = model.config
    if untied_head(model):
        config = dataclasses.replace(config, tie_embeddings=False)
    values = config.to_huginn_dict()  # before anything in `path` is touched
    check_saveable(model, path)
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"].clone()  # (safetensors refuses tensors sharing memory)
    table = rope_table(config.head_dim, config.max_seq_len, config.rope_base)
    state["freqs_cis"] = table.unsqueeze(1).unsqueeze(0).contiguous()
    dtypes = {t.dtype for name, t in state.items() if name != "freqs_cis"}
    values["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(state, out, max_shard_bytes, None, json.dumps(values, indent=2) + "\n")


def untied_head(model: torch.nn.Module) -> bool:
    """Whether `model`'s config ties the lm_head to the embedding but its lm_head holds other values, as peft's
    merge_and_unload leaves a model whose adapter trained a copy of the head (modules_to_save=["lm_head"])."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_embeddings", getattr(config, "tie_word_embeddings", False)):
        return False
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    transformer = getattr(model, "transformer", None)
    wte = getattr(transformer["wte"], "weight", None) if transformer is not None and "wte" in transformer else None
    if not isinstance(head, torch.Tensor) or not isinstance(wte, torch.Tensor) or head is wte:
        return False
    return head.shape != wte.shape or not torch.equal(head.detach().cpu(), wte.detach().cpu())


def _check_tokenizer_fits(tokenizer: Any, vocab_size: int) -> None:
    """A one-line ValueError where the tokenizer to save makes ids past the model's vocabulary: every
    `--model` load refuses such a directory (a sentencepiece-only directory is not read here)."""
    from tokenizers import Tokenizer

    from recurrent_depth.data.tokenizer import check_fits_vocab, load_tokenizer

    if isinstance(tokenizer, str | os.PathLike) and (Path(tokenizer) / "tokenizer.json").is_file():
        check_fits_vocab(load_tokenizer(tokenizer), vocab_size, tokenizer)
    elif isinstance(tokenizer, Tokenizer):
        check_fits_vocab(tokenizer, vocab_size, "tokenizer")
    elif isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer):  # a transformers fast tokenizer
        check_fits_vocab(tokenizer.backend_tokenizer, vocab_size, getattr(tokenizer, "name_or_path", "tokenizer"))


def save_tokenizer_files(tokenizer: Any, out: Path, model_max_length: int | None = None) -> None:
    """`tokenizer` (a directory, a `tokenizers.Tokenizer` or a transformers tokenizer) into `out`."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, str | os.PathLike):
        if not any((Path(tokenizer) / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
            # (a retrofitted sentencepiece source holds only tokenizer.model: copied as tokenizer_dir= copies it)
            raise FileNotFoundError(f"tokenizer={str(tokenizer)!r} is not a directory holding tokenizer.json "
                                    f"(or a sentencepiece tokenizer.model)")
        copy_tokenizer(tokenizer, out)
    elif isinstance(tokenizer, Tokenizer):
        from recurrent_depth.data.tokenizer import save_tokenizer

        try:
            save_tokenizer(tokenizer, out, model_max_length=model_max_length)
        except ValueError:  # not one of ours (no chat tokens): the tokenizer and a config AutoTokenizer reads
            atomic_write_text(out / "tokenizer.json", tokenizer.to_str(pretty=True))
            atomic_write_text(out / "tokenizer_config.json",
                              json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    elif hasattr(tokenizer, "save_pretrained"):  # a transformers tokenizer
        tokenizer.save_pretrained(str(out))
    else:
        raise ValueError(f"tokenizer must be a tokenizers.Tokenizer, a transformers tokenizer or a directory, "
                         f"got {type(tokenizer).__name__}")


def copy_tokenizer(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        return
    from recurrent_depth.files import TOKENIZER_MAX_BYTES, atomic_write_bytes, read_bytes

    # Each a bounded regular file (a symlink to /dev/zero filled the disk, one to a huge file was copied
    # whole), all read before any is written; symlinks are followed, as a hub snapshot's files are ones.
    files = {name: read_bytes(src / name, TOKENIZER_MAX_BYTES, "tokenizer file")
             for name in TOKENIZER_FILES if (src / name).exists()}
    for name, data in files.items():
        atomic_write_bytes(dst / name, data)


def current_umask() -> int:
    """The process's file-creation mask (os.umask can only be read by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def weight_files(path: Path, allow_outside: bool = False) -> list[Path]:
    """The safetensors files of a model directory, single or sharded.

    A directory holding both `model.safetensors` and a shard index loads the single file, as transformers'
    `from_pretrained` does (it looks for the single file first). An index's `weight_map` may name only files inside
    the directory (no absolute or `..` paths) unless `allow_outside=True`; symlinked files are followed (a Hugging
    Face hub snapshot is made of them into its blob store) to regular files only as large as their header says
    (`files`).
    """
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    if (path / INDEX_NAME).exists():
        index = read_json(path / INDEX_NAME, CONFIG_MAX_BYTES, "weight index")
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{path / INDEX_NAME} has no 'weight_map'")
        names = sorted({str(name) for name in index["weight_map"].values()})
        return [inside(path, name, f"{INDEX_NAME}: weight file", allow_outside, follow_links=True) for name in names]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise ValueError(f"{path} holds only pickled weights (.bin/.pt); convert them to safetensors first")
    raise FileNotFoundError(f"no safetensors weights in {path}")


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
_OTHER_DTYPES = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}


# The embedding's name in each format we load (ours and Huginn's, Ouro's).
EMBEDDING_NAMES = ("transformer.wte.weight", ouro.EMBEDDING)


def model_identity(directory: str | os.PathLike[str]) -> str:
    """A cheap fingerprint of the model in `directory`: the sha256 of its config.json with the name, size and
    mtime of each weight file (`*.safetensors`, `*.bin` and their index), so that a model retrained (or replaced)
    in place, or another model of the same config, is told apart without hashing gigabytes of weights. (A copy
    keeps it only with its mtimes: `cp -p`, `rsync -t`.) A distillation cache records its teacher's
    (`train/distill.py`), a training run the model directory it started from (`train/trainer_checkpoints.py`)."""
    directory = Path(directory)
    digest = hashlib.sha256(read_bytes(directory / "config.json", CONFIG_MAX_BYTES, "model config"))
    for path in _fingerprinted_weight_files(directory):
        info = path.stat()
        digest.update(f"\n{path.name}\0{info.st_size}\0{info.st_mtime_ns}".encode())
    return digest.hexdigest()


def model_content_sample(directory: str | os.PathLike[str], chunks: int = 16, chunk_bytes: int = 64 * 1024) -> str:
    """A fingerprint of what the model in `directory` holds, not of when it was written: the sha256 of its
    config.json with each weight file's name, size and `chunks` evenly spaced reads of `chunk_bytes` (1 MiB a
    file). A copy made without its mtimes keeps it; a model trained further (every tensor moves) does not.
    `trainer_checkpoints.check_same_start` falls back to it when `model_identity`'s mtimes differ."""
    directory = Path(directory)
    digest = hashlib.sha256(read_bytes(directory / "config.json", CONFIG_MAX_BYTES, "model config"))
    for path in _fingerprinted_weight_files(directory):
        fd, size = open_regular(path, None, "weight file")
        digest.update(f"\n{path.name}\0{size}".encode())
        with os.fdopen(fd, "rb") as handle:
            for k in range(chunks):
                handle.seek(max(size - chunk_bytes, 0) * k // max(chunks - 1, 1))
                digest.update(handle.read(chunk_bytes))
    return digest.hexdigest()


def model_dir_record(directory: str | os.PathLike[str]) -> dict[str, str]:
    """What a run records of a model directory it reads (where it started, its teacher) so that a resume can refuse
    one changed since: its absolute path, `model_identity` and `model_content_sample`."""
    return {"directory": str(Path(directory).resolve()), "identity": model_identity(directory),
            "content": model_content_sample(directory)}


def file_digests(directory: str | os.PathLike[str], names: Collection[str]) -> dict[str, str | None]:
    """{name: the sha256 of `directory`/name, None where there is none} for each of `names` (a model directory's
    small files: tokenizer, retrofit.json, ...; bounded reads): whether two directories hold the same such files,
    and which ones differ."""
    directory = Path(directory)
    return {name: file_sha256(directory / name, TOKENIZER_MAX_BYTES, f"file {name}")
            if (directory / name).exists() else None for name in names}


def _fingerprinted_weight_files(directory: Path) -> list[Path]:
    """The files `model_identity` and `model_content_sample` read beside config.json, by name: every weight file
    (`*.safetensors`, `*.bin`) and shard index, so both fingerprints cover the same files."""
    return [path for path in sorted(directory.iterdir())
            if path.name.endswith((".safetensors", ".bin", ".index.json")) and path.is_file()]


def stored_dtype(path: str | os.PathLike[str]) -> torch.dtype | None:
    """The dtype of the stored embedding (`EMBEDDING_NAMES`), read from the file headers only.

    None when `path` is not a local model directory with safetensors weights holding that tensor.
    """
    path = Path(path)
    if not path.is_dir():
        return None
    try:
        for file in weight_files(path):
            header = parse_safetensors_header(file)
            for name in EMBEDDING_NAMES:
                if name in header:
                    return _SAFETENSORS_DTYPES.get(header[name][0])
    except (OSError, ValueError):
        return None  # the loader itself reports unreadable files
    return None


def read_header_shapes(
    path: str | os.PathLike[str], allow_outside: bool = False
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (safetensors dtype, shape)} of every weight file of a model directory, headers only."""
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in weight_files(Path(path), allow_outside):
        for name, entry in parse_safetensors_header(file).items():
            if name in tensors:
                raise ValueError(f"tensor {clipped(name)} is stored twice (again in {file})")
            tensors[name] = entry
    return tensors


def read_state_dict(
    path: str | os.PathLike[str], dtype: torch.dtype | None = None, allow_outside: bool = False,
    names: Collection[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's weight files (only those in `names` when given: a conversion
    that drops layers never reads them), floating-point ones cast to `dtype` when given."""
    state: dict[str, torch.Tensor] = {}
    wanted = None if names is None else set(names)
    for file in weight_files(Path(path), allow_outside):
        fd, size = open_regular(file, None, "weights file")
        with os.fdopen(fd, "rb") as checked:
            read_safetensors_header(checked, size, file)  # a regular, complete file: one-line errors first
            try:  # read from the file checked (a symlink is followed once)
                with safe_open(reopen_path(checked, file), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                        if wanted is not None and name not in wanted:
                            continue
                        tensor = handle.get_tensor(name)
                        state[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
            except SafetensorError as exc:
                raise ValueError(f"{file} is not a readable safetensors file: {clipped(str(exc), 300)}") from None
    return state


def _check_layer_counts(config: ModelConfig, header: dict[str, tuple[str, tuple[int, ...]]], path: Path) -> None:
    """Layer counts and the embedding's shape from the header against the config, before the model is built
    (building a model of 200,000 layers to find that the file holds 4 takes minutes)."""
    problems = []
    for part, field in (("prelude", "prelude_layers"), ("core_block", "core_layers"), ("coda", "coda_layers")):
        prefix = f"transformer.{part}."
        indices = {name[len(prefix):].split(".", 1)[0] for name in header if name.startswith(prefix)}
        stored = len({i for i in indices if i.isdigit()})
        if stored != getattr(config, field):
            problems.append(f"config.json {field}={getattr(config, field)} but the weights hold {stored} {part} layers")
    wte = header.get("transformer.wte.weight")
    if wte is not None and tuple(wte[1]) != (config.vocab_size, config.hidden_size):
        problems.append(f"config.json vocab_size x hidden_size = {(config.vocab_size, config.hidden_size)} but the "
                        f"stored transformer.wte.weight is {tuple(wte[1])}")
    if problems:
        raise ValueError(f"cannot load {path}: " + "; ".join(problems))


def usable_device(device: Any) -> torch.device:
    """`device` as a torch.device that this machine has, or a ValueError naming it (not a traceback from
    deep inside the first copy, e.g. "Torch not compiled with CUDA enabled")."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1'): {exc}") from exc
    if parsed.type == "meta":
        return parsed
    try:
        torch.empty(0, device=parsed)
    except (RuntimeError, AssertionError) as exc:
        raise ValueError(f"device {device!r} is not available on this machine: {exc}") from exc
    return parsed


@dataclass(frozen=True)
class CheckedDir:
    """A model directory that passed `check_model_dir`: its config, the model built on the meta
    device, whether the stored head is the tied embedding, and whether the tensors are Ouro's or Parcae's."""

    config: ModelConfig
    meta_model: Any
    tied_head: bool
    is_ouro: bool = False
    is_parcae: bool = False


def lora_adapter_hint(path: str | os.PathLike[str], merged_for: str | None = None) -> str:
    """For an error about a directory without config.json: '' or, when it (or its model/) is a peft LoRA
    adapter (an `rdepth train|sft --lora` run's output), how to use it instead. `merged_for`: where only a
    merged model will do (a start point, a teacher), what to use the merged model as."""
    p = Path(path)
    if not ((p / "adapter_config.json").is_file() or (p / "model" / "adapter_config.json").is_file()):
        return ""
    merge = "merge it into a model with `rdepth export --merge-lora`"
    if merged_for is not None:
        return f"; it is a LoRA adapter (adapter_config.json): {merge} and {merged_for}"
    return ("; it is a LoRA adapter (adapter_config.json): load its base model with it (--lora on the command line "
            "of rdepth generate, serve, eval and analyze, peft=ADAPTER in rdepth lm-eval's model_args, "
            f"recurrent_depth.train.lora.load_adapter_model in Python), or {merge}")


def check_model_dir(
    path: str | os.PathLike[str],
    config_overrides: dict[str, Any] | None = None,
    allow_outside: bool = False,
    *,
    model_class: type[torch.nn.Module],
    head_instead: str | None = None,
) -> CheckedDir:
    """Every check of a model directory that needs no tensor data, as one-line errors: the config
    read bounded and validated, the weight files (regular, bounded, headers that fit their files)
    and their names, shapes and dtypes against the model the config describes. Each loader runs it
    first (`load_pretrained`, and transformers' `from_pretrained` through our classes). An Ouro
    directory's tensors are checked under their own names first (`families/ouro.py`); a Parcae
    directory's header entries are renamed to ours first (`families/parcae.py`). `head_instead`: the tensor of a
    head the loading class has in place of the lm_head (transformers' sequence classifier: "score.weight"), which
    may be stored (`[n, hidden_size]`) or not; the lm_head is then neither required nor refused."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json: expected a saved model directory (config.json and "
                                f"safetensors weights; a training run keeps its model in its model/ directory)"
                                + lora_adapter_hint(path))
    raw = parse_json(read_text(path / "config.json", CONFIG_MAX_BYTES, "config file"), "config")
    config = ModelConfig.from_dict(raw)
    is_ouro = isinstance(raw, dict) and ouro.is_ouro_config(raw)
    is_parcae = isinstance(raw, dict) and parcae.is_parcae_config(raw)
    if config_overrides:
        values = config.to_dict()
        values.pop("model_type")
        values.update(config_overrides)
        config = ModelConfig.from_dict(values)
    header = read_header_shapes(path, allow_outside)
    if is_ouro:
        header = ouro.translate_header(header, config, frozenset(_SAFETENSORS_DTYPES), path)
    if is_parcae:
        header = parcae.parcae_header(header, config)
    for name in IGNORED_TENSORS:
        header.pop(name, None)
    if any(name.startswith("base_model.model.") for name in header):  # a LoRA run's checkpoint (the peft wrapper)
        raise ValueError(f"cannot load {path}: its weights are a peft LoRA wrapper's (base_model.model.* names), "
                         f"a LoRA run's checkpoint" + (lora_adapter_hint(path) or ""))
    _check_layer_counts(config, header, path)

    with torch.device("meta"):
        model = model_class(config)
    expected = {name: p for name, p in model.state_dict().items()}
    problems: list[str] = []
    if head_instead is not None:
        expected.pop("lm_head.weight", None)
        header.pop("lm_head.weight", None)
        head = header.pop(head_instead, None)
        if head is not None and (len(head[1]) != 2 or head[1][1] != config.hidden_size):
            problems.append(f"{head_instead}: file {tuple(head[1])} vs model (num_labels, {config.hidden_size})")
    tied_head = config.tie_embeddings and "lm_head.weight" in header
    stored = {name: entry for name, entry in header.items() if not (tied_head and name == "lm_head.weight")}
    wte = header.get("transformer.wte.weight")
    if tied_head and wte is not None and tuple(header["lm_head.weight"][1]) != tuple(wte[1]):
        problems.append("lm_head.weight differs from transformer.wte.weight but the config ties them")
    required = set(expected) - ({"lm_head.weight"} if config.tie_embeddings else set())
    missing = sorted(required - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    mis_shaped = sorted(
        f"{name}: file {tuple(stored[name][1])} vs model {tuple(expected[name].shape)}"
        for name in set(stored) & set(expected)
        if tuple(stored[name][1]) != tuple(expected[name].shape)
    )
    wrong_dtype = sorted(
        f"{name}: {_OTHER_DTYPES.get(stored[name][0], stored[name][0])}"
        for name in set(stored) & set(expected) if stored[name][0] not in _SAFETENSORS_DTYPES
    )
    # (each list clipped: a forged header can name a million tensors, each a megabyte long)
    if missing:
        problems.append(f"missing tensors: {clipped_names(missing)}")
    if wrong_dtype:
        problems.append(f"tensors that are not floating point: {clipped_names(wrong_dtype)}")
    if unexpected:
        problems.append(f"unexpected tensors: {clipped_names(unexpected)}")
    if mis_shaped:
        problems.append(f"mis-shaped tensors: {clipped_names(mis_shaped)}")
    if problems:
        raise ValueError(f"cannot load {path}: " + "; ".join(problems))
    return CheckedDir(config, model, tied_head, is_ouro, is_parcae)


def load_pretrained(
    path: str | os.PathLike[str],
    dtype: torch.dtype | str | None = None,
    device: Any = "cpu",
    config_overrides: dict[str, Any] | None = None,
    allow_outside: bool = False,
    *,
    model_class: type[torch.nn.Module],
    weights: str | None = None,
) -> Any:
    """Build a `model_class` (`RecurrentDepthLM`, whose `from_pretrained` calls this) from a model
    directory (ours, official Huginn-0125, Ouro or Parcae).

    Everything is checked before a tensor is allocated (`check_model_dir`): the config's bounds,
    then its shapes against the safetensors headers. `allow_outside=True` lets an index name
    weight files outside `path`. `weights="int8"` / `"int4"` / `"int4:g<group>"` quantizes the
    transformer's linear layers after loading (`recurrent_depth.weight_quant.quantize_weights`; None
    keeps them as loaded).
    """
    check_weights(weights)
    device = usable_device(device)
    path = Path(path)
    checked = check_model_dir(path, config_overrides, allow_outside, model_class=model_class)
    config, model, tied_head = checked.config, checked.meta_model, checked.tied_head
    dtype = dtype_from_name(dtype)
    state = read_state_dict(path, dtype, allow_outside)
    # (a diverged run's checkpoint generated token 0 on every step, without a word)
    broken = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if broken:
        raise ValueError(f"cannot load {path}: {len(broken)} weight tensor(s) hold NaN or inf, e.g. "
                         f"{clipped_names(broken, 3)} (a damaged checkpoint, or one saved after training diverged)")
    if checked.is_ouro:
        state = ouro.fuse_state(state, config)
    if checked.is_parcae:
        state = parcae.parcae_state_dict(state, config)
    for name in IGNORED_TENSORS:
        state.pop(name, None)
    wte_tensor = state["transformer.wte.weight"]
    wte_dtype = wte_tensor.dtype if wte_tensor.is_floating_point() else torch.float32
    if tied_head:
        head = state.pop("lm_head.weight")
        if not torch.equal(head.to(wte_tensor.dtype), wte_tensor):
            raise ValueError(f"cannot load {path}: lm_head.weight differs from transformer.wte.weight but the "
                             f"config ties them")

    # assign=True adopts the loaded tensors instead of copying them: one copy of the weights in memory.
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    model.to(device=device, dtype=dtype or wte_dtype)
    model.eval()
    quantize_weights(model, weights)
    return model
