"""GLM-5 / GLM-5.1 checkpoints (GLM-MoE-DSA, `glm_moe_dsa`): probe.checkpoint_deepseek's latent attention (its rotary
pairs written back evens first, always; a query latent, always) and DeepSeek-V3's routed experts after
first_k_dense_replace dense layers (or as mlp_layer_types says), plus each layer's sparse-attention indexer
(probe.sparse_indexer) under transformers' names, `self_attn.indexer.wq_b`, `wk`, `k_norm` (a LayerNorm with a bias),
`weights_proj`. Layers whose indexer_types entry is "shared" have no indexer and read the keys the layer before
chose; config.json gives indexer_types, or index_topk_pattern ("FSSF..."), or index_topk_freq and
index_skip_topk_offset, read as transformers reads them. The multi-token-prediction layer after the last is not
read."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_deepseek import latent_config, latent_config_to_hf, latent_family
from probe.checkpoint_source import Source
from probe.config import DecoderConfig, SparseIndexer
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

MODEL_TYPE = "glm_moe_dsa"
_to_probe, _to_hf = latent_family(MODEL_TYPE)


def indexer_types(hf: dict) -> list[str]:
    """Each layer's indexer kind, "full" or "shared", as transformers' GlmMoeDsaConfig derives it."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("indexer_types")
    if kinds is None and hf.get("index_topk_pattern") is not None:
        pattern = hf["index_topk_pattern"]
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    if kinds is None:
        freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"full", "shared"} or kinds[0] != "full":
        raise CheckpointError(f"indexer_types={kinds!r} must say 'full' or 'shared' for each of the {n} layers, the "
                              "first 'full' (a shared layer reads the keys an earlier one chose)")
    return kinds


def glm_dsa_config(hf: dict) -> DecoderConfig:
    cfg = latent_config(MODEL_TYPE)(hf)
    kinds = indexer_types(hf)
    indexer = SparseIndexer(n_heads=hf.get("index_n_heads", 32), d_head=hf.get("index_head_dim", 128),
                            topk=hf.get("index_topk", 2048),
                            shared=tuple(kind == "shared" for kind in kinds) if "shared" in kinds else ())
    return dataclasses.replace(cfg, latent_attention=dataclasses.replace(cfg.latent_attention, indexer=indexer))


def glm_dsa_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    latent = cfg.latent_attention
    if latent is not None and not latent.deinterleaved:
        raise ValueError(f"a {MODEL_TYPE} checkpoint's rotary pairs are written back evens first (deinterleaved); this "
                         f"model has latent_attention={latent!r}")
    out = latent_config_to_hf(MODEL_TYPE)(cfg, tokenizer)  # (refuses a model without an indexer)
    indexer = latent.indexer
    del out["rope_interleave"]  # (not a field of this format: always interleaved)
    out.update(index_n_heads=indexer.n_heads, index_head_dim=indexer.d_head, index_topk=indexer.topk,
               indexer_types=["shared" if indexer.layer_shared(l) else "full" for l in range(cfg.n_layers)],
               num_nextn_predict_layers=0)  # (probe holds no multi-token-prediction layers)
    return out


def indexer_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape) for every layer's indexer tensors, relative to the file's `model.`."""
    latent, d = cfg.latent_attention, cfg.d_model
    spec = latent.indexer
    table = {}
    for l in (l for l in range(cfg.n_layers) if not spec.layer_shared(l)):
        o, t = f"blocks.{l}.attn.indexer", f"layers.{l}.self_attn.indexer"
        table.update({f"{o}.wq_b.weight": (f"{t}.wq_b.weight", (spec.n_heads * spec.d_head, latent.q_rank)),
                      f"{o}.wk.weight": (f"{t}.wk.weight", (spec.d_head, d)),
                      f"{o}.k_norm.weight": (f"{t}.k_norm.weight", (spec.d_head,)),
                      f"{o}.k_norm.bias": (f"{t}.k_norm.bias", (spec.d_head,)),
                      f"{o}.weights_proj.weight": (f"{t}.weights_proj.weight", (spec.n_heads, d))})
    return table


def glm_dsa_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in indexer_names(cfg).items()}
    out.update(_to_probe(source, cfg))
    return out


def glm_dsa_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = _to_hf(params, cfg)
    out.update({f"model.{theirs}": params[ours].contiguous() for ours, (theirs, _) in indexer_names(cfg).items()})
    return out
