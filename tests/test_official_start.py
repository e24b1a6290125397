"""From the official Huginn-0125 layout and back: fine-tune an official directory, then `rdepth export
--official-layout` writes the result as the official files are, for the official modeling code to load."""

import json

import pytest
import torch
from safetensors import safe_open

import recurrent_depth as rd
from recurrent_depth.checkpoint import weight_files
from recurrent_depth.cli import main
from recurrent_depth.model.layers import rope_table
from tests.test_init_from import train_flags, write_official
from tests.train_support import VOCAB, OneThread, prepare_root

# What the official download carries beside its weights: the modeling files its auto_map names (stand-ins here:
# they are never run) and the generation defaults.
AUTO_MAP = {"AutoConfig": "raven_config_minimal.RavenConfig",
            "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"}
GENERATION = {"bos_token_id": 352, "eos_token_id": [353, 356], "pad_token_id": 357}


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("official_root"))


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def write_download(path, root):
    """An official directory as downloaded: bf16 shards, RavenConfig keys with an auto_map, its modeling files."""
    write_official(path, root)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "auto_map": AUTO_MAP}))
    for target in AUTO_MAP.values():
        (path / f"{target.rsplit('.', 1)[0]}.py").write_text(f"# the official {target}\n")
    (path / "generation_config.json").write_text(json.dumps(GENERATION))


def stored(directory):
    tensors = {}
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return tensors


def logits(model):
    x = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    return model(x, num_steps=3, init_scale=0.0).logits


def test_a_fine_tuned_official_model_is_written_back_in_the_official_layout(train_root, tmp_path):
    """Before, `rdepth export` had no way back: a Huginn-0125 fine-tuned here could only be published in the
    library's layout (model_type recurrent_depth), which the official modeling code does not load."""
    from transformers import AutoModelForCausalLM

    download = tmp_path / "huginn"
    write_download(download, train_root)
    assert main(train_flags(train_root, download, tmp_path / "run", "--max-steps", "1")) == 0
    tuned, out = tmp_path / "run" / "model", tmp_path / "published"
    assert main(["export", "--model", str(tuned), "--out", str(out), "--official-layout", "--official-code",
                 str(download), "--max-shard-mb", "0.2"]) == 0

    config = json.loads((out / "config.json").read_text())
    original = json.loads((download / "config.json").read_text())
    assert config["model_type"] == "huginn_raven" and config["auto_map"] == AUTO_MAP
    assert config["torch_dtype"] == "bfloat16" and "hidden_size" not in config
    for key in ("n_embd", "n_heads", "n_layers", "n_layers_in_prelude", "n_layers_in_recurrent_block",
                "n_layers_in_coda", "block_size", "vocab_size", "intermediate_size", "mean_recurrence"):
        assert config[key] == original[key], key
    for target in AUTO_MAP.values():
        name = f"{target.rsplit('.', 1)[0]}.py"
        assert (out / name).read_bytes() == (download / name).read_bytes()
    assert json.loads((out / "generation_config.json").read_text()) == GENERATION
    assert (out / "tokenizer.json").read_bytes() == (download / "tokenizer.json").read_bytes()

    # The official tensor names, shapes and dtype: lm_head stored beside the embedding, the fp32 RoPE buffer.
    tensors, official = stored(out), stored(download)
    assert len(weight_files(out)) > 1 and sorted(tensors) == sorted(official)
    for name, tensor in tensors.items():
        assert tensor.shape == official[name].shape and tensor.dtype == official[name].dtype, name
    assert torch.equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])
    cfg = rd.ModelConfig.from_json(out / "config.json")
    assert torch.equal(tensors["freqs_cis"][0, :, 0], rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_base))

    # The same model: through the library and through transformers' official architecture name.
    reference = logits(rd.RecurrentDepthLM.from_pretrained(tuned, dtype=torch.float32))
    assert torch.equal(logits(rd.RecurrentDepthLM.from_pretrained(out, dtype=torch.float32)), reference)
    raven = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(raven).__name__ == "RavenForCausalLM" and torch.equal(logits(raven), reference)


def test_official_layout_refusals_name_the_problem_before_writing(train_root, tmp_path, capsys):
    source = tmp_path / "gqa"
    torch.manual_seed(0)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, num_kv_heads=2)).save_pretrained(source)
    # bias=True reads back from the official keys, but the official code puts a bias on the adapter only: it
    # dropped the 32 attention and MLP biases of the golden-sized model (unexpected keys) and its logits differed.
    biased = tmp_path / "biased"
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, bias=True)).save_pretrained(biased)
    write_download(tmp_path / "huginn", train_root)
    cases = [
        ([str(source)], "cannot express this model's num_kv_heads=2 (the official code hard-codes num_kv_heads=4)"),
        ([str(biased)], "cannot express this model's bias=True (the official code's bias is the adapter's only"),
        ([str(tmp_path / "huginn"), "--remote-code"], "--official-layout and --remote-code write two different"),
        ([str(tmp_path / "huginn"), "--official-code", str(source)], f"--official-code {source}: expected an "
                                                                     "official Huginn-0125 directory"),
    ]
    for model, message in cases:
        out = tmp_path / "out"
        assert main(["export", "--model", *model, "--out", str(out), "--official-layout"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not out.exists()


def test_official_layout_without_the_official_files_has_no_auto_map(train_root, tmp_path):
    """From a model directory of ours (no official modeling files anywhere), the layout is still official;
    transformers loads it through the library's class for model type huginn_raven."""
    source = tmp_path / "ours"
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB))
    model.save_pretrained(source, tokenizer=train_root / "tokenizer")
    assert main(["export", "--model", str(source), "--out", str(tmp_path / "out"), "--official-layout"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "huginn_raven" and "auto_map" not in config and config["torch_dtype"] == "float32"
    assert not list((tmp_path / "out").glob("*.py"))
    assert torch.equal(logits(rd.RecurrentDepthLM.from_pretrained(tmp_path / "out")), logits(model.eval()))
