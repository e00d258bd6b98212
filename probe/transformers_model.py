"""A model as a `transformers` model of its checkpoint's family, holding its weights as they are now: what
transformer-lens 4's `bridge.original_model` gives the code that reads it (lm-eval's HFLM, a notebook checking its
logits against `transformers`). And a checkpoint's architecture with `transformers`' own initial weights, what the
bridge boots with `load_weights=False`.

The copy computes what the model computes, processed weights included: a folded norm is written with w = 1 and
b = 0, and a folded final-norm bias (an unembedding bias, which no Hugging Face format holds) becomes the bias of
the output layer. Unlike the bridge's, it is a separate model: probe's hooks do not run in it, and its weights and
the model's do not follow each other's later edits."""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from probe.checkpoints import family_for_config
from probe.loading import resolve_checkpoint
from probe.norm import folded_norm_weights


def initialised_like_transformers(name_or_path, revision=None) -> nn.Module:
    """The checkpoint's `transformers` model built from its config alone (`from_config`: transformers' initial
    weights, drawn from torch's global stream), as transformer-lens 4 boots with `load_weights=False`."""
    transformers = _transformers("load_weights=False")
    directory = resolve_checkpoint(name_or_path, revision)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))


def _transformers(what: str):
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"{what} builds a transformers model, and transformers is not installed: "
                          "pip install transformers") from err
    return transformers


def to_transformers(model: nn.Module) -> nn.Module:
    """A `transformers` causal LM (the checkpoint's class where it can hold the weights, in eval mode, on the model's
    embedding device and dtype) whose logits are the model's."""
    transformers = _transformers("original_model")
    cfg = dataclasses.replace(model.cfg, norm_weights=True, unembed_bias=False)  # as written: both filled in below
    family = _family(cfg)
    tensors = {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}
    for name, module in model.named_modules():  # a folded norm's w = 1 and b = 0, kept as buffers
        tensors.update(folded_norm_weights(module, name))
    # through a checkpoint, so transformers' own loader applies its names, prefixes and tying
    with tempfile.TemporaryDirectory(prefix="probe-original-model-") as directory:
        (Path(directory) / "config.json").write_text(json.dumps(family.config_to_hf(cfg, model.tokenizer)))
        save_file({name: t.cpu().contiguous() for name, t in family.to_hf(tensors, cfg).items()},
                  str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
        hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True,
                                                                           output_loading_info=True)
    left = {kind: sorted(info.get(kind) or ()) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(left.values()):  # a family table out of step with transformers: never hand back a half-loaded model
        raise RuntimeError(f"original_model: transformers' {type(hf_model).__name__} did not take the weights as "
                           f"written ({left})")
    device, dtype = model.embed.W_E.device, model.embed.W_E.dtype
    hf_model = hf_model.to(device=device, dtype=dtype)
    if model.cfg.unembed_bias:
        head = hf_model.get_output_embeddings()
        biased = nn.Linear(head.in_features, head.out_features, bias=True, device=device, dtype=dtype)
        biased.weight = head.weight  # the same parameter: a tied model stays tied
        with torch.no_grad():
            biased.bias.copy_(model.unembed.bias)
        hf_model.set_output_embeddings(biased)
    return hf_model.eval()


def _family(cfg):
    """The first family whose format holds these weights: the checkpoint's own, but where processing added biases
    its format has no place for (a Qwen2 model's output bias), one that has (Llama's)."""
    try:
        return family_for_config(cfg)
    except ValueError as err:
        raise ValueError(f"original_model: {err}") from None
