"""A BERT-style prediction head between the final norm and W_U (ModernBERT's decoders, the Ettin models):
logits = W_U LN(act(dense(ln_final(x)))) + b_U.

It lives inside the unembedding (`unembed.head`), so everything that unembeds a residual, `model.unembed(
model.ln_final(resid))` (the logit lens, metrics read from the final residual, faithfulness runs), passes through
it and gets the model's own logits. What it breaks is the linearity the direct attributions rest on: the
logits are no longer W_U times the normalised residual, so a residual component's share of them is undefined, and
those analyses refuse a model with one (probe.analyses.architecture.refuse_prediction_head).

Its points: `unembed.head.hook_pre` (the dense layer's output), `hook_post` (after the activation) and its
LayerNorm's `ln.hook_scale` / `ln.hook_normalized`; its input is `ln_final.hook_out` and its output
`unembed.hook_in`, the bridge's `prediction_head.hook_in` / `hook_out` (probe.bridge_names)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from probe.activations import ACTIVATIONS
from probe.config_choices import Norm
from probe.embedding import Unembed
from probe.hooks import HookPoint
from probe.norm import NORMS


class PredictionHeadModule(nn.Module):
    """dense -> activation -> LayerNorm, [batch pos d_model] -> [batch pos d_model]."""

    def __init__(self, cfg):
        super().__init__()
        spec = cfg.prediction_head
        self.dense = nn.Linear(cfg.d_model, cfg.d_model, bias=spec.bias)
        self.act_fn = ACTIVATIONS[spec.act]()
        self.ln = NORMS[Norm.LAYER](cfg.d_model, cfg.eps)
        self.hook_pre = HookPoint()  # [batch pos d_model]: dense(x)
        self.hook_post = HookPoint()  # [batch pos d_model]: act(dense(x)), what the LayerNorm reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.hook_post(self.act_fn(self.hook_pre(self.dense(x)))))


class HeadedUnembed(Unembed):
    """The unembedding with the prediction head first: unembed(x) = W_U head(x) + b_U. `uncapped` passes through the
    head too, so what reads the logits from the final norm's output reads the model's; W_U alone is the decoder."""

    def __init__(self, cfg):
        super().__init__(cfg.d_vocab_out, cfg.d_model, bias=cfg.unembed_bias, softcap=cfg.logit_softcap)
        self.head = PredictionHeadModule(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch pos d_model] -> [batch pos vocab]
        return self.cap(self.hook_out(F.linear(self.hook_in(self.head(x)), self.weight, self.bias)))

    def uncapped(self, x: torch.Tensor) -> torch.Tensor:
        return super().uncapped(self.head(x))

    def w_u_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def make_unembed(cfg) -> Unembed:
    """The config's unembedding: W_U alone, or with a prediction head before it (cfg.prediction_head)."""
    if cfg.prediction_head is not None:
        return HeadedUnembed(cfg)
    return Unembed(cfg.d_vocab_out, cfg.d_model, bias=cfg.unembed_bias, softcap=cfg.logit_softcap)


def refuse_prediction_head(cfg, what: str) -> None:
    """Refuse `what`, which takes the logits for W_U times the final norm's output (a sum of each residual
    component's share), on a model whose prediction head lies between the two."""
    if cfg.prediction_head is not None:
        raise ValueError(
            f"{what}: this model's final norm feeds a prediction head (a dense layer, {cfg.prediction_head.activation} "
            f"and a LayerNorm: unembed.head, ModernBERT's lm_head) before W_U, so its logits are no linear function of "
            f"the residual stream and no component, direction or token column has a direct share of them; what runs "
            f"the model's own head works: logit_lens, patch(...), ablate_heads, attention_patterns, the cache's "
            f"decompose_resid / accumulated_resid, and model.unembed(model.ln_final(resid)) for a residual's logits")


def prediction_head_names(cfg, aliases: dict[str, str], left_out: dict[str, str]) -> None:
    """transformer-lens 4's names on a model with a prediction head (ModernBERT decoder's adapter), added to those
    probe.bridge_names gives every model: the head's ends are points probe has already, and the bridge's `mlp.in`
    is transformers' `Wi`, both halves of the gated MLP's input projection in one."""
    if cfg.prediction_head is None:
        return
    aliases.update({"prediction_head.hook_in": "ln_final.hook_out", "prediction_head.hook_out": "unembed.hook_in"})
    for layer in range(cfg.n_layers):
        b = f"blocks.{layer}.mlp"
        aliases.pop(f"{b}.in.hook_out", None)
        left_out[f"{b}.in.hook_out"] = (
            f"the bridge's is Wi's whole output [batch pos 2*d_mlp], both halves of the gated MLP's input; probe "
            f"hooks them apart: {b}.hook_pre (the first half, which the activation reads) and {b}.hook_pre_linear (the "
            f"second, which multiplies it). (The bridge's {b}.hook_pre is that whole output too; probe's is "
            f"transformer-lens's, the first half)")
