"""RWKV-4 checkpoints (`rwkv`, RwkvForCausalLM: RWKV/rwkv-4-169m-pile ... 14b-pile and the Raven chat models), every
layer a time mix and a channel mix (probe.rwkv) under `rwkv.`, the head `head` (untied in every release).

transformers normalises the embedding in block 0 (`blocks.0.pre_ln`): probe's embedding norm, embed.ln. Its last norm
(`ln_out`) keeps LayerNorm's default eps, 1e-5, whatever layer_norm_epsilon says; every release has 1e-5, and probe
has one eps, so a file with another is refused rather than read one norm off.

`rescale_every`: in eval mode transformers divides each layer's two output projections by 2^(layer // rescale_every)
and halves the residual stream after every rescale_every-th layer, so fp16 does not overflow. The logits are the same
up to the LayerNorms' eps (each norm reads a residual scaled by a power of 2, and eps is not scaled with it); its
hidden states past layer rescale_every - 1 are probe's divided by that power. probe keeps the trained model's weights
and residual stream as they are, in every dtype, and leaves rescale_every out of config.json (transformers' default,
6, then applies to a saved file, as to the released ones)."""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_source import Source, require_fields, special_token_ids, take_unembed, with_defaults
from probe.config import Activation, DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.config_rwkv import Rwkv
from probe.tokenizer import Tokenizer

LN_OUT_EPS = 1e-5  # transformers' ln_out: nn.LayerNorm's default, not layer_norm_epsilon
NORMS = (("w", "weight"), ("b", "bias"))  # ours, theirs


def rwkv_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, context_length=1024, attention_hidden_size=None, intermediate_size=None,
                       layer_norm_epsilon=1e-5, tie_word_embeddings=False)
    if hf["layer_norm_epsilon"] != LN_OUT_EPS:
        raise CheckpointError(f"layer_norm_epsilon={hf['layer_norm_epsilon']!r}: transformers' RWKV normalises its "
                              f"output with eps {LN_OUT_EPS} whatever this says, and probe has one eps for every norm; "
                              f"only {LN_OUT_EPS} (every release's) is read")
    d = hf["hidden_size"]
    # (no attention: nothing reads positions or heads; one head of d_model, as Mamba's)
    return DecoderConfig(n_layers=hf["num_hidden_layers"], d_model=d, n_heads=1, d_head=d, d_vocab=hf["vocab_size"],
                         n_ctx=hf["context_length"], d_mlp=hf["intermediate_size"] or 4 * d, eps=LN_OUT_EPS,
                         activation=Activation.RELU2, norm=Norm.LAYER, positions=Positions.ROTARY, embed_norm=True,
                         qkv_bias=False, out_bias=False, mlp_bias=False, tied_embeddings=hf["tie_word_embeddings"],
                         rwkv=Rwkv(d_attention=hf["attention_hidden_size"] or d))


def rwkv_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    if cfg.rwkv is None:
        raise ValueError("an rwkv checkpoint holds RWKV-4 layers (time and channel mixes); this model has none")
    if cfg.eps != LN_OUT_EPS:
        raise ValueError(f"an rwkv checkpoint's last norm has eps {LN_OUT_EPS} whatever the others' is; this model's "
                         f"norms have eps={cfg.eps}")
    require_fields(cfg, "rwkv", rwkv=cfg.rwkv, embed_norm=True, norm=Norm.LAYER, norm_placement=NormPlacement.PRE,
                   positions=Positions.ROTARY, activation=Activation.RELU2, gated_mlp=False, attn_only=False,
                   qkv_bias=False, out_bias=False, mlp_bias=False, final_norm=True)
    return {"model_type": "rwkv", "architectures": ["RwkvForCausalLM"], "vocab_size": cfg.d_vocab,
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
            "attention_hidden_size": cfg.rwkv.d_attention, "intermediate_size": cfg.d_mlp,
            "context_length": cfg.n_ctx, "layer_norm_epsilon": cfg.eps, "tie_word_embeddings": cfg.tied_embeddings,
            **special_token_ids(tokenizer)}


def rwkv_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape), theirs under `rwkv.` (stripped on reading), the head apart."""
    d, width, m = cfg.d_model, cfg.rwkv.d_attention, cfg.d_mlp
    table = {"embed.W_E": ("embeddings.weight", (cfg.d_vocab, d))}
    table.update({f"embed.ln.{ours}": (f"blocks.0.pre_ln.{theirs}", (d,)) for ours, theirs in NORMS})
    table.update({f"ln_final.{ours}": (f"ln_out.{theirs}", (d,)) for ours, theirs in NORMS})
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"blocks.{l}"
        for norm in ("ln1", "ln2"):
            table.update({f"{o}.{norm}.{ours}": (f"{t}.{norm}.{theirs}", (d,)) for ours, theirs in NORMS})
        time = {"time_decay": (width,), "time_first": (width,), "time_mix_key": (1, 1, d), "time_mix_value": (1, 1, d),
                "time_mix_receptance": (1, 1, d), "key.weight": (width, d), "value.weight": (width, d),
                "receptance.weight": (width, d), "output.weight": (d, width)}
        channel = {"time_mix_key": (1, 1, d), "time_mix_receptance": (1, 1, d), "key.weight": (m, d),
                   "receptance.weight": (d, d), "value.weight": (d, m)}
        table.update({f"{o}.time_mix.{name}": (f"{t}.attention.{name}", shape) for name, shape in time.items()})
        table.update({f"{o}.channel_mix.{name}": (f"{t}.feed_forward.{name}", shape)
                      for name, shape in channel.items()})
    return table


def rwkv_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in rwkv_names(cfg).items()}
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"], ("head.weight",))
    return out


def rwkv_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {f"rwkv.{theirs}": params[ours] for ours, (theirs, _) in rwkv_names(cfg).items()}
    if not cfg.tied_embeddings:
        out["head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
