"""save_pretrained / from_pretrained: ours, sharded, and the official Huginn-0125 layout."""

import json

import pytest
import torch
from safetensors.torch import save_file

import recurrent_depth as rd
from tests.test_config import HUGINN_CONFIG_JSON


def logits(model, seed=0):
    x = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    return model(x, num_steps=3, init_scale=0.0).logits


def test_save_then_load_gives_identical_logits(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path)
    assert torch.equal(logits(loaded), logits(tiny_model))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied weights stay tied
    assert not loaded.training


def test_sharded_save_and_dtype_choice(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path, max_shard_bytes=64_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path)
    assert torch.equal(logits(loaded), logits(tiny_model))
    as_bf16 = rd.RecurrentDepthLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16
    assert logits(as_bf16).dtype == torch.float32  # logits always float32


def test_untied_model_round_trips(tmp_path):
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", tie_embeddings=False)).eval()
    model.save_pretrained(tmp_path)
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is not loaded.transformer.wte.weight
    assert torch.equal(logits(loaded), logits(model))


def write_official_layout(model, path, dtype=torch.bfloat16, with_head=True, extra=None, drop=None):
    """A directory as the official Huginn files are: Huginn config keys, shards + index, freqs_cis."""
    cfg = model.config
    config = dict(HUGINN_CONFIG_JSON)
    config.update(n_embd=cfg.hidden_size, n_heads=cfg.num_heads, n_layers=cfg.num_layers,
                  n_layers_in_prelude=cfg.prelude_layers, n_layers_in_recurrent_block=cfg.core_layers,
                  n_layers_in_coda=cfg.coda_layers, mean_recurrence=cfg.mean_recurrence,
                  mean_backprop_depth=cfg.mean_backprop_depth, block_size=cfg.max_seq_len,
                  vocab_size=cfg.vocab_size, intermediate_size=cfg.intermediate_size)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    state = {k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()}
    if not with_head:
        state.pop("lm_head.weight")
    state["freqs_cis"] = torch.zeros(1, cfg.max_seq_len, 1, cfg.head_dim // 2, 2)
    state.update(extra or {})
    for name in drop or []:
        state.pop(name)
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(path / file))
        weight_map.update(dict.fromkeys(keys, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("with_head", [True, False], ids=["head-stored", "head-absent"])
def test_loads_official_huginn_layout(tiny_model, tmp_path, with_head):
    write_official_layout(tiny_model, tmp_path, with_head=with_head)
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16  # the stored dtype unless asked
    as_fp32 = rd.RecurrentDepthLM.from_pretrained(tmp_path, dtype=torch.float32)
    reference = rd.RecurrentDepthLM(tiny_model.config).eval()
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in tiny_model.state_dict().items()})
    assert torch.equal(logits(as_fp32), logits(reference))


def test_bad_checkpoints_list_what_is_wrong(tiny_model, tmp_path):
    write_official_layout(tiny_model, tmp_path / "a", drop=["transformer.adapter.weight"],
                          extra={"transformer.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"missing tensors: \['transformer.adapter.weight'\].*unexpected"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path / "a")
    write_official_layout(tiny_model, tmp_path / "b", extra={"transformer.ln_f.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="mis-shaped tensors"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path / "b")
    write_official_layout(tiny_model, tmp_path / "c", extra={"lm_head.weight": torch.zeros(256, 64)})
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path / "c")
    with pytest.raises(FileNotFoundError):
        rd.RecurrentDepthLM.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(tiny_model.config.to_json())
    (tmp_path / "d" / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="pickled"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path / "d")


def test_damaged_files_and_integer_tensors_name_the_file_or_tensor(tiny_model, tmp_path):
    write_official_layout(tiny_model, tmp_path / "index", dtype=torch.float32)
    (tmp_path / "index" / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path / "index")
    tiny_model.save_pretrained(tmp_path / "corrupt")
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path / "corrupt")
    # An integer tensor would be adopted as is (model.to(dtype) casts floating tensors only).
    write_official_layout(tiny_model, tmp_path / "int", dtype=torch.float32,
                          extra={"transformer.ln_f.weight": torch.ones(64, dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"not floating point: \['transformer.ln_f.weight: torch.int32'\]"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path / "int")


def test_an_unusable_device_is_a_value_error_naming_it(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'nonsense' is not a torch device"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path, device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda' is not available on this machine"):
            rd.RecurrentDepthLM.from_pretrained(tmp_path, device="cuda")
    assert next(rd.RecurrentDepthLM.from_pretrained(tmp_path, device="cpu").parameters()).device.type == "cpu"


def test_weights_holding_nan_or_inf_are_refused_at_load(tmp_path):
    """A diverged run's saved model loaded, and `rdepth generate` printed token 0 at every step, silently."""
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
    with torch.no_grad():
        model.transformer.core_block[0].mlp.proj.weight[0, 0] = float("nan")
        model.lm_head.weight[1, 1] = float("inf")
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"2 weight tensor\(s\) hold NaN or inf, e.g. .*core_block.0.mlp.proj"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path / "m")


def test_save_with_a_sentencepiece_only_tokenizer_directory_copies_it(tiny_model, tmp_path):
    """A retrofitted sentencepiece source's directory holds tokenizer.model and no tokenizer.json:
    save_pretrained(tokenizer=DIR) refused it (tokenizer_dir=DIR copied it); both copy it now."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.model").write_bytes(b"\x0a\x03abc")
    (src / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    tiny_model.save_pretrained(tmp_path / "out", tokenizer=src)
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == b"\x0a\x03abc"
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    with pytest.raises(FileNotFoundError, match="is not a directory holding tokenizer.json"):
        tiny_model.save_pretrained(tmp_path / "out2", tokenizer=tmp_path / "out2")


def test_save_with_a_tokenizer_larger_than_the_vocabulary_is_refused_before_writing(tiny_model, tmp_path):
    """README's save_pretrained(DIR, tokenizer=...) wrote a directory every --model load then refused (a
    tokenizer with more tokens than vocab_size); it is refused at save now, naming both sizes."""
    from recurrent_depth.evaluation.reasoning.data import byte_tokenizer

    big = byte_tokenizer()  # 288 tokens
    assert tiny_model.config.vocab_size < 288
    big.save(str(tmp_path / "tokenizer.json"))
    for tokenizer in (big, tmp_path):
        with pytest.raises(ValueError, match=r"has 288 tokens but the model's vocabulary has \d+"):
            tiny_model.save_pretrained(tmp_path / "out", tokenizer=tokenizer)
        assert not (tmp_path / "out").exists()
