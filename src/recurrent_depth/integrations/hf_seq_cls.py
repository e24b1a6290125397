"""`AutoModelForSequenceClassification` for recurrent-depth models: reward models (trl's RewardTrainer) and
classification fine-tuning (transformers' Trainer).

    import recurrent_depth  # registers the Auto classes
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)   # a causal-LM directory (or Ouro)
    scores = model(input_ids, attention_mask=mask, num_steps=8).logits                # [B, num_labels]

As transformers' `*ForSequenceClassification` models: a score head `Linear(hidden_size, num_labels, bias=False)`
reads the backbone's last hidden state (what the causal LM's lm_head reads: ln_f of the last core state, through
the coda) at each row's last token; loading a causal-LM directory leaves the head freshly initialised (transformers
warns so); `labels` give the loss of `config.problem_type` (regression, single- or multi-label classification).
The backbone is `RecurrentDepthForCausalLM`'s (`base_model`), so `num_steps`, `init_scale`, `input_states`,
`generator` and the training-mode depth sampling work as in the causal LM.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from transformers.loss.loss_utils import ForSequenceClassificationLoss
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from recurrent_depth.integrations.hf import _HUB_KWARGS, OuroForCausalLM, RecurrentDepthForCausalLM, _Backbone
from recurrent_depth.integrations.hf_config import HuginnRavenConfig, OuroConfig, RecurrentDepthConfig


class RecurrentDepthForSequenceClassification(RecurrentDepthForCausalLM):
    """A recurrent-depth backbone with a `score` head on each row's last token (transformers' convention).

    The last token of a row is the last position its `attention_mask` keeps (left and right padding alike); without
    a mask, the last token that is not `config.pad_token_id` (transformers' rule), or the last position of a lone row.
    """

    _tied_weights_keys: dict[str, str] = {}  # no lm_head
    # a causal-LM checkpoint's separate lm_head is the head this class replaces
    _keys_to_ignore_on_load_unexpected = [r"^freqs_cis$", r"^lm_head\.weight$"]
    # the loss is a mean over the batch's rows: the Trainer's `num_items_in_batch` (a token count) does not apply
    accepts_loss_kwargs = False
    _head_instead = "score.weight"  # what the directory checks (checkpoint.check_model_dir) allow for the lm_head

    def __init__(self, config: RecurrentDepthConfig | HuginnRavenConfig) -> None:
        super().__init__(config)
        del self.lm_head  # the core keeps its own (unused here: the backbone reads the lm_head's input)
        self.num_labels = config.num_labels
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    @property
    def base_model(self) -> nn.Module:
        """The backbone: `base_model(input_ids, ...)` returns the hidden states the score head reads."""
        return _Backbone(self, forward=partial(RecurrentDepthForCausalLM.forward, self))

    def get_output_embeddings(self) -> None:
        return None

    def set_output_embeddings(self, value: nn.Module) -> None:
        raise ValueError("a sequence classifier has no output embeddings (its head is `score`)")

    @classmethod
    def can_generate(cls) -> bool:
        return False

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("a sequence classifier does not generate: load the directory with AutoModelForCausalLM")

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutputWithPast | tuple:
        """Scores `[B, num_labels]` of each row's last token. Other keyword arguments are the causal LM's forward
        arguments (`num_steps`, `init_scale`, `input_states`, `generator`, `use_cache`, `output_hidden_states`, ...).
        labels: `[B]` class ids (single-label), `[B]` / `[B, num_labels]` floats (regression, multi-label)."""
        if input_ids is None:
            raise ValueError("input_ids is required")
        kwargs.setdefault("use_cache", False)  # a classifier reads the whole sequence once
        kwargs.pop("margin", None)  # trl's RewardTrainer passes its margins with the batch (its loss reads them)
        out = self.base_model(input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        hidden = out.last_hidden_state
        rows = torch.arange(input_ids.shape[0], device=hidden.device)
        last = _last_token(input_ids, attention_mask, self.config.pad_token_id).to(hidden.device)
        logits = self.score(hidden[rows, last])
        loss = None
        if labels is not None:
            loss = ForSequenceClassificationLoss(labels=labels, pooled_logits=logits, config=self.config)
        result = SequenceClassifierOutputWithPast(
            loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states, attentions=out.attentions,
        )
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return result if return_dict else result.to_tuple()


def _last_token(input_ids: Tensor, attention_mask: Tensor | None, pad_token_id: int | None) -> Tensor:
    """Each row's last real position `[B]`: the mask's last kept position, else the last non-pad token."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                             f"{tuple(input_ids.shape)}: they must match")
        keep = attention_mask.to(input_ids.device) != 0
    elif pad_token_id is not None:
        keep = input_ids != pad_token_id
    elif input_ids.shape[0] == 1:
        keep = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        raise ValueError("a batch of several rows needs an attention_mask or config.pad_token_id to find each "
                         "row's last token")
    if not bool(keep.any(-1).all()):
        raise ValueError("a row has no token to score: its attention_mask (or every token is the pad token) "
                         "leaves nothing")
    return (positions * keep).argmax(-1)


class RavenForSequenceClassification(RecurrentDepthForSequenceClassification):
    """The official Huginn-0125 architecture with a score head, through our implementation."""

    config_class = HuginnRavenConfig


# a classifier's fields of transformers' config, carried from an OuroConfig to ours
_LABEL_FIELDS = ("id2label", "label2id", "problem_type")


class OuroForSequenceClassification(RecurrentDepthForSequenceClassification):
    """An Ouro directory (model type ``ouro``) through `AutoModelForSequenceClassification`, without remote code.

    `from_pretrained` loads the backbone as `OuroForCausalLM` does (the library's reader, Ouro's tensors renamed
    and fused; the same arguments: `dtype`, `device_map`, `weights`, `config`, Ouro config keys, hub arguments),
    plus transformers' label arguments (`num_labels`, `id2label`, `label2id`, `problem_type`), and puts a fresh
    score head on it (Ouro's lm_head is left out, as for any causal-LM directory). It returns a
    `RecurrentDepthForSequenceClassification` whose config is our `RecurrentDepthConfig`: `save_pretrained`
    writes our format, which loads back with its trained head.
    """

    config_class = OuroConfig

    def __init__(self, config: OuroConfig | RecurrentDepthConfig) -> None:
        if isinstance(config, OuroConfig):  # built from a config (from_config): our config from the start
            labels = {name: getattr(config, name) for name in _LABEL_FIELDS}
            config = RecurrentDepthConfig.from_model_config(config.to_model_config(), **labels)
        super().__init__(config)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.pop("config", None)
        if config is None:  # read here, so that the label arguments land on it (hub arguments serve both reads)
            hub = {name: kwargs[name] for name in _HUB_KWARGS if name in kwargs}
            config, kwargs = OuroConfig.from_pretrained(str(pretrained_model_name_or_path),
                                                        return_unused_kwargs=True, **kwargs)
            kwargs.update(hub)
        lm = OuroForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)
        ours = lm.config
        for name in _LABEL_FIELDS:
            setattr(ours, name, getattr(config, name, getattr(ours, name)))
        with torch.device("meta"):
            model = RecurrentDepthForSequenceClassification(ours)
        model.transformer = lm.transformer  # the loaded modules, shared with the library model
        object.__setattr__(model, "_core", lm.core)
        model._output_projections = {
            id(m) for name, m in model.named_modules() if name.endswith(("attn.proj", "mlp.proj"))
        }
        embedding = lm.transformer.wte.weight
        model.score = nn.Linear(ours.hidden_size, ours.num_labels, bias=False, device=embedding.device,
                                dtype=embedding.dtype)
        model._init_weights(model.score)  # as transformers initialises a head the directory does not hold
        model.train(lm.training)
        return model


def register_sequence_classification() -> None:
    """`AutoModelForSequenceClassification.register` for our configs (idempotent)."""
    from transformers.models.auto.modeling_auto import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.register(RecurrentDepthConfig, RecurrentDepthForSequenceClassification,
                                                exist_ok=True)
    AutoModelForSequenceClassification.register(HuginnRavenConfig, RavenForSequenceClassification, exist_ok=True)
    AutoModelForSequenceClassification.register(OuroConfig, OuroForSequenceClassification, exist_ok=True)
