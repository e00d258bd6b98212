"""EXAONE 3.0 / 3.5 checkpoints (LG AI Research): Llama's model under GPT-2-style names. The released files name the
blocks `transformer.h.{l}` (`ln_1`, `ln_2`, `attn.attention.{q,k,v,out}_proj`, `mlp.c_fc_0` the gate, `c_fc_1` the
up projection, `c_proj` the down) around `transformer.wte` / `ln_f`, and their config.json says `num_layers`,
`layer_norm_epsilon` and `activation_function` for Llama's fields (transformers reads them so, and runs Llama). Both
spellings are read; probe saves the released names, as transformers does.

EXAONE 4.0 (`exaone4`) has Llama's names and OLMo 2's block (an RMSNorm on each sublayer's write and none before it;
each head's q and k normalised), with three windowed layers in four (`layer_types`, or every `sliding_window_pattern`-th layer full):
only those rotate, the full layers have no positions (none without a window: then every layer is full and rotates)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_source import Source, layer_kinds, layer_types_to_hf, with_defaults
from probe.config import DecoderConfig, NormPlacement
from probe.config_file import ConfigFields
from probe.tokenizer import Tokenizer

CONFIG_NAMES = {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
                "activation_function": "hidden_act"}  # EXAONE's -> Llama's
# EXAONE's module names -> Llama's: the top level's, and each block's (after `h.{l}.` / `layers.{l}.`)
TOP = {"wte": "embed_tokens", "ln_f": "norm"}
BLOCK = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", **{f"attn.attention.{p}_proj": f"self_attn.{p}_proj"
         for p in "qkv"}, "attn.attention.out_proj": "self_attn.o_proj", "mlp.c_fc_0": "mlp.gate_proj",
         "mlp.c_fc_1": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}


def _renamed(name: str, top: dict[str, str], block: dict[str, str], blocks: tuple[str, str]) -> str:
    """`name` (a prefix-free tensor name) with its module renamed by `top` or, inside block `l` (`blocks[0]` + l),
    by `block`, the block itself then called `blocks[1]` + l."""
    module, kind = name.rsplit(".", 1)
    if module in top:
        return f"{top[module]}.{kind}"
    if module.startswith(blocks[0]):
        layer, part = module[len(blocks[0]):].split(".", 1)
        return f"{blocks[1]}{layer}.{block.get(part, part)}.{kind}"
    return name


def exaone_config(hf: dict) -> DecoderConfig:
    fields = {CONFIG_NAMES.get(key, key): value for key, value in hf.items()}
    return llama_config(with_defaults(ConfigFields(fields, getattr(hf, "path", Path("config.json")),
                                                   getattr(hf, "prefix", "")), rope_theta=500_000.0), default_eps=1e-5)


def exaone_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    out = llama_config_to_hf(cfg, tokenizer, "exaone")
    return {next((k for k, v in CONFIG_NAMES.items() if v == key), key): value for key, value in out.items()}


def exaone_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """The released names read as Llama's (a file already under Llama's names is read as it is)."""
    source.state = {_renamed(name, TOP, BLOCK, ("h.", "layers.")): t for name, t in source.state.items()}
    return llama_to_probe(source, cfg)


def exaone_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    top, block = {v: k for k, v in TOP.items()}, {v: k for k, v in BLOCK.items()}
    return {name if name == "lm_head.weight" else
            "transformer." + _renamed(name.removeprefix("model."), top, block, ("layers.", "h.")): t
            for name, t in llama_to_hf(params, cfg).items()}


def exaone4_config(hf: dict) -> DecoderConfig:
    base = dataclasses.replace(llama_config(hf, default_eps=1e-5),
                               norm_placement=NormPlacement.SANDWICH, input_norms=False, qk_norm=True)
    window = hf.get("sliding_window", 4096)
    if window is None:
        return base
    sliding = tuple(kind == "sliding_attention" for kind in layer_kinds(hf, hf.get("sliding_window_pattern", 4)))
    return dataclasses.replace(base, sliding_window=window if any(sliding) else None,
                               sliding_layers=sliding if any(sliding) else None, rotary_layers=sliding if any(sliding) else None)


def exaone4_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    windowed = tuple(cfg.layer_window(l) is not None for l in range(cfg.n_layers))
    if cfg.sliding_window is not None and windowed != tuple(cfg.layer_rotates(l) for l in range(cfg.n_layers)):
        raise ValueError("an exaone4 checkpoint with a window rotates exactly its windowed layers; this model's "
                         f"rotary_layers {cfg.rotary_layers} are not its windowed ones {windowed}")
    out = llama_config_to_hf(cfg, tokenizer, "exaone4")
    out.pop("mlp_bias")
    out.update(sliding_window=cfg.sliding_window, layer_types=layer_types_to_hf(cfg),
               sliding_window_pattern=None if cfg.sliding_window is None else 4)
    return out
